"""What a step brings back to the host, unpacked from its packed f32 outputs.

The step's sampler packs, per sample row, [token, logprob, rank, top-K ids, top-K logprobs,
draft accepted] (4 + 2K floats, integers bit-cast); prompt logprobs pack, per step token, [logprob, rank,
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
    # speculative decoding: request id -> the tokens it keeps after `sampled`'s (accepted drafts,
    # then the recovered or bonus token), and how many drafts it verified
    accepted: dict[str, list[SampledToken]] = dataclasses.field(default_factory=dict)
    num_drafts: dict[str, int] = dataclasses.field(default_factory=dict)


def _as_int(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int32)


def _tokens(rows: np.ndarray, K: int) -> list[SampledToken]:
    """The SampledToken of each of `rows` (f32[n, 4 + 2K]), column by column (a decode step of 256
    rows: one conversion per column, not per row)."""
    tokens, ranks, top_ids = (_as_int(rows[:, c]).tolist() for c in (slice(0, 1), slice(2, 3), slice(3, 3 + K)))
    logprobs, top_logprobs = rows[:, 1].tolist(), rows[:, 3 + K:3 + 2 * K].tolist()
    return [SampledToken(t[0], lp, rank[0], ids, lps)
            for t, lp, rank, ids, lps in zip(tokens, logprobs, ranks, top_ids, top_logprobs)]


def _rows(flat: np.ndarray, num_rows: int, K: int) -> np.ndarray:
    return flat.reshape(num_rows, 4 + 2 * K)


def unpack_sampled(flat: np.ndarray, rows: list[tuple[str, int]], num_rows: int, K: int) -> dict[str, SampledToken]:
    """request id -> its sampled token, for `rows` (request id, sample row) of f32[num_rows * (4 + 2K)]."""
    if not rows:
        return {}
    request_ids, indices = zip(*rows)
    return dict(zip(request_ids, _tokens(_rows(flat, num_rows, K)[list(indices)], K)))


def unpack_accepted(flat: np.ndarray, spec_rows: list[tuple[str, int, int]], num_rows: int,
                    K: int) -> dict[str, list[SampledToken]]:
    """Speculative decoding: request id -> the tokens of the rows after its first one that it keeps,
    for `spec_rows` (request id, first sample row, drafts verified): row j + 1 is kept when the
    drafts of rows 0 .. j were all accepted."""
    main = _rows(flat, num_rows, K)
    out = {}
    for request_id, first, num_drafts in spec_rows:
        accepted = _as_int(main[first:first + num_drafts, -1])
        kept = int(np.argmin(accepted)) if not accepted.all() else num_drafts
        out[request_id] = _tokens(main[first + 1:first + 1 + kept], K)
    return out


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
