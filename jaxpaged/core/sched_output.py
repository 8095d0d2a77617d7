"""What the scheduler hands out: a step's plan (SchedulerOutput of ScheduledChunks) and what a
step's results changed (StepUpdate). Plain data, no arrays (vLLM's core/sched/output.py)."""

import dataclasses

from jaxpaged.core.host_cache import HostMoves
from jaxpaged.core.request import Request, RequestStatus


class ScheduledChunk:
    """One request's share of a step: `num_new_tokens` tokens from position `start`.

    `block_ids` is the request's whole block table, the KV cache manager's own list (not a copy:
    a step in flight reads it when dispatched). Speculative decoding: the chunk's last `num_drafts`
    tokens are request.spec_token_ids[:num_drafts]. `samples`: whether the step reaches the end of
    the request's tokens (so a token is sampled), fixed when scheduled, before commit() adds the
    placeholder. `forks` (n > 1): the sibling sequences that sample their first token beside the
    request in this step, from the same logits (commit() forks them off the request)."""

    __slots__ = ("request", "start", "block_ids", "__dict__")   # (the rest: PlainDecode's are class constants)

    def __init__(self, request: Request, start: int, num_new_tokens: int, block_ids: list[int], num_drafts: int = 0):
        self.request = request
        self.start = start
        self.num_new_tokens = num_new_tokens
        self.block_ids = block_ids
        self.num_drafts = num_drafts
        self.samples = start + num_new_tokens - num_drafts == request.num_tokens_with_placeholders
        self.forks = list(request.pending_forks) if self.samples else []

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.request.request_id!r}, start={self.start}, "
                f"new={self.num_new_tokens}, drafts={self.num_drafts}, samples={self.samples})")


class PlainDecode(ScheduledChunk):
    """A ScheduledChunk of one token that samples, without drafts or forks: a decode inside a block
    the request holds alone (the scheduler's common case, made without the checks)."""

    __slots__ = ()
    num_new_tokens, num_drafts, samples, forks = 1, 0, True, ()

    def __init__(self, request: Request, start: int, block_ids: list[int]):
        self.request, self.start, self.block_ids = request, start, block_ids


@dataclasses.dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Request]
    num_batched_tokens: int
    # block moves the device runs before the step, in this order:
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (device, host)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)    # (host, device)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)     # (src, dst) copy-on-write
    # requests finished (stopped, aborted) since the last plan: the runner frees their slots
    finished: list[Request] = dataclasses.field(default_factory=list)
    # the first chunks are plain decodes (PlainDecode: one token, sampled; no drafts, no
    # forks; blocks unchanged since the request's last step), which a runner may take as columns
    num_plain_decodes: int = 0
    # the host tier's stores, loads and drops (kv_offloading_size), applied with the block moves; None: none
    host: HostMoves | None = None
    committed: bool = False    # see Scheduler.commit
    dispatched_at: float = 0.0  # perf_counter() when the engine queued the step (its prefill-rate clock)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclasses.dataclass
class StepUpdate:
    """What update_from_output did: the requests that got tokens, each with its index in the
    step's result (its first token's row there)."""
    progressed: list[tuple[Request, int]]
    num_kept: dict[str, int] = dataclasses.field(default_factory=dict)   # speculative decoding: tokens kept after the first
    # the requests a token stopped, with their status and stop reason (as decided: a later abort
    # changes the request, not this)
    finished: list[tuple[Request, RequestStatus, int | None]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens the requests got in all."""
        return len(self.progressed) + sum(self.num_kept.values())
