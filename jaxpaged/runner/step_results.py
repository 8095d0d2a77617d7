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


class StepResult:
    """A step's sampled tokens, column by column: per sampled request (n > 1 forks included), in
    sample-row order, its first token and that token's logprob; the rest of each row (rank,
    top-K) is read only for the requests that ask (`token(i)`).

    `kept` (speculative decoding): request id -> the token ids it keeps after its first (accepted
    drafts, then the recovered or bonus token), `kept_rows` their sample rows, `num_drafts` how many
    drafts it verified. `prompt_logprobs`: request id -> its prompt logprobs of this step."""

    def __init__(self, requests: list, rows: list[int], packed: np.ndarray, K: int,
                 prompt_logprobs: dict[str, "PromptLogprobs"] | None = None,
                 spec_rows: list[tuple[str, int, int]] = ()):
        self.requests = requests
        self.rows = rows
        self.K = K
        self.packed = packed.reshape(-1, 4 + 2 * K) if packed is not None else np.zeros((0, 4 + 2 * K), np.float32)
        picked = self.packed[rows] if rows else self.packed[:0]
        self.token_ids: list[int] = _as_int(picked[:, 0]).tolist()
        self.logprobs: list[float] = picked[:, 1].tolist()
        self.prompt_logprobs = prompt_logprobs or {}
        self.pooled: dict[str, np.ndarray] = {}   # runner="pooling": request id -> its final-normed last hidden state
        self.kept: dict[str, list[int]] = {}
        self.kept_rows: dict[str, list[int]] = {}
        self.num_drafts: dict[str, int] = {}
        for request_id, first, num_drafts in spec_rows:
            accepted = _as_int(self.packed[first:first + num_drafts, -1])
            num_kept = int(np.argmin(accepted)) if not accepted.all() else num_drafts
            kept_rows = list(range(first + 1, first + 1 + num_kept))
            self.kept_rows[request_id] = kept_rows
            self.kept[request_id] = _as_int(self.packed[kept_rows, 0]).tolist() if kept_rows else []
            self.num_drafts[request_id] = num_drafts

    def token(self, row: int) -> SampledToken:
        """Everything sample row `row` holds (its token, logprob, rank and top-K)."""
        (token,), (rank,) = _as_int(self.packed[row, 0:1]).tolist(), _as_int(self.packed[row, 2:3]).tolist()
        K = self.K
        return SampledToken(token, float(self.packed[row, 1]), rank, _as_int(self.packed[row, 3:3 + K]).tolist(),
                            self.packed[row, 3 + K:3 + 2 * K].tolist())

    @property
    def sampled(self) -> dict[str, SampledToken]:
        """request id -> its first token, in full (for callers off the hot path: beam search, drafters)."""
        return {request.request_id: self.token(row) for request, row in zip(self.requests, self.rows)}


def _as_int(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int32)


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
