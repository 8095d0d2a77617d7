"""What a step brings back to the host, unpacked from its packed f32 outputs.

The step's sampler packs, per sample row, [token, logprob, rank, top-K ids, top-K logprobs]
(3 + 2K floats, integers bit-cast); prompt logprobs pack, per step token, [logprob, rank,
top-K ids, top-K logprobs] (2 + 2K). `runner/step.py` (`_pack`) writes them.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclasses.dataclass
class PromptLogprobs:
    """For prompt tokens start+1 .. start+n of one request: logprob, rank and top-k each."""
    start: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclasses.dataclass
class StepResult:
    sampled: dict[str, SampledToken]
    prompt_logprobs: dict[str, PromptLogprobs]


def _as_int(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int32)


def unpack_sampled(flat: np.ndarray, rows: list[tuple[str, int]], num_rows: int, K: int) -> dict[str, SampledToken]:
    """request id -> its sampled token, for `rows` (request id, sample row) of f32[num_rows * (3 + 2K)]."""
    main = flat.reshape(num_rows, 3 + 2 * K)
    return {request_id: SampledToken(int(_as_int(main[r, 0:1])[0]), float(main[r, 1]), int(_as_int(main[r, 2:3])[0]),
                                     _as_int(main[r, 3:3 + K]).tolist(), main[r, 3 + K:3 + 2 * K].tolist())
            for request_id, r in rows}


def unpack_prompt_logprobs(flat: np.ndarray, lp_rows: list[tuple[str, int, int, int]],
                           K: int) -> dict[str, PromptLogprobs]:
    """request id -> its prompt logprobs, for `lp_rows` (request id, first flat token, count, start)."""
    lp = flat.reshape(-1, 2 + 2 * K)
    out = {}
    for request_id, first, count, start in lp_rows:
        block = lp[first:first + count]
        out[request_id] = PromptLogprobs(start, block[:, 0].tolist(), _as_int(block[:, 1]).tolist(),
                                         _as_int(block[:, 2:2 + K]).tolist(), block[:, 2 + K:].tolist())
    return out
