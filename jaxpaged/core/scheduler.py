"""Continuous batching: decide, each step, which requests compute how many tokens.

One token budget per step (`max_num_batched_tokens`); running requests first, in order,
then waiting requests in arrival order. A step freely mixes decodes (1 token), whole
prompts and (with chunked prefill) prompt chunks. When the pool runs out of blocks the
newest running request is preempted: its blocks are freed (recompute) and it returns to
the front of the waiting queue, keeping the tokens it generated.

LongRoPE (Phi-3) encodes every position with other factors once a sequence is longer than
the model's original length, and transformers then recomputes the sequence's whole cache.
So does this scheduler: a request whose K/V began shorter than that length is preempted by
recompute when it outgrows it (once), and its K/V is computed anew with the long factors.

Only host state changes here: the plan goes out as a `SchedulerOutput`.
"""

import dataclasses
from collections import deque

from jaxpaged.core.kv_cache_manager import KVCacheManager, cdiv
from jaxpaged.core.request import FINISHED, Request, RequestStatus, advance_grammar, token_stop
from jaxpaged.core.sched_output import PlainDecode, ScheduledChunk, SchedulerOutput, StepUpdate

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StepUpdate"]


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    max_loras: int = 0                 # multi-LoRA: most adapters running at once (0: no LoRA)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}) when chunked prefill is off, or no long prompt could run")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager):
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []      # finished since the last plan (it hands them to the runner)
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        # Each check below stops a request that could never be scheduled: it would sit at the
        # head of the waiting queue (or preempt itself) forever and stall every request behind it.
        if request.num_tokens < 1:
            raise ValueError(f"prompt_token_ids must hold at least 1 token, got {request.num_tokens}")
        self.check_prompt_len(request.num_tokens)
        # The caller finishes a request at max_tokens outputs or max_model_len tokens, and the
        # K/V of the last sampled token is never computed. A request that outgrew the pool would
        # preempt itself forever.
        longest = min(request.num_tokens + max(request.max_tokens or 1, 1) - 1, self.config.max_model_len)
        if cdiv(longest, self.kv_cache.block_size) > self.kv_cache.pool.num_usable_blocks:
            raise ValueError(f"prompt of {request.num_tokens} tokens plus max_tokens={request.max_tokens} "
                             f"can never fit in the KV cache: min(prompt + max_tokens - 1, max_model_len) "
                             f"must be <= {self.kv_cache.max_tokens_per_request()} tokens")
        if self._num_seats(request) > self.config.max_num_seqs:
            raise ValueError(f"n={self._num_seats(request)} sequences for one request is more than "
                             f"max_num_seqs ({self.config.max_num_seqs})")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_prompt_len(self, num_tokens: int) -> None:
        """ValueError unless a prompt of `num_tokens` leaves room for one generated token."""
        max_model_len = self.config.max_model_len
        if num_tokens >= max_model_len:
            raise ValueError(f"prompt is {num_tokens} tokens, but max_model_len is {max_model_len}: "
                             f"the prompt must be at most {max_model_len - 1} tokens")

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Mark finished (stopped, length or aborted) and free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        request.status = status
        self.kv_cache.free(request)
        self.finished.append(request)
        return request

    def fork(self, parent: Request, child: Request) -> None:
        """Start `child` running on the parent's blocks (shared by refcount, copied on write)."""
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already in use")
        self.kv_cache.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.rope_len = parent.rope_len
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- the plan ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []   # plain decodes (the plan's first chunks)
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        # The common case first, in one tight pass: a plain decode (one new token; no drafts, forks
        # to start or LongRoPE) inside a block it holds alone, neither starting nor filling a block: nothing to
        # allocate, share or register. Every other request takes the general path below.
        bs = self.kv_cache.block_size
        req_blocks, ref_cnt = self.kv_cache.req_blocks, self.kv_cache.pool.ref_cnt
        max_len = self.config.max_model_len
        plain = not self.kv_cache.rope_switch_len
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            length = len(request.all_token_ids) + request.num_placeholders
            if (plain and length - start == 1 and 0 < start % bs < bs - 1 and not request.spec_token_ids
                    and not request.pending_forks):
                if request.num_placeholders and (len(request.output_token_ids) + request.num_placeholders
                                                 >= request.max_tokens or length >= max_len):
                    i += 1   # the step in flight samples its last token
                    continue
                blocks = req_blocks[request.request_id]
                if ref_cnt[blocks[start // bs]] == 1:
                    decodes.append(PlainDecode(request, start, blocks))
                    budget -= 1
                    i += 1
                    continue
            num_new = 0 if self._ends_in_flight(request) else \
                self._num_new_tokens(request, request.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            if self.kv_cache.outgrows_rope(request.rope_len, request.num_tokens_with_placeholders):
                self.running.pop(i)
                self._preempt(request, recompute=True)
                preempted.append(request)
                continue
            num_drafts = self._num_drafts(request, num_new, budget)
            # drafts are optional: they take free slots only, never a preemption
            if num_drafts and self.kv_cache.allocate_slots(request, num_new + num_drafts) is not None:
                num_new += num_drafts
            else:
                num_drafts = 0
                while self.kv_cache.allocate_slots(request, num_new) is None:
                    victim = self.running.pop()
                    swap_out += self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if request in preempted:
                    break
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new,
                                         self.kv_cache.blocks_of(request.request_id), num_drafts))
            budget -= num_new
            i += 1

        # a request that will fork (n > 1) takes its children's seats when admitted, so the forks
        # never push the running batch past max_num_seqs
        seats = sum(map(self._num_seats, self.running))
        # multi-LoRA: a request whose adapter would be one too many waits (others pass it)
        loras = {r.lora_int_id for r in self.running if r.lora_int_id}
        # swapped requests come back before any new request is admitted
        while self.swapped and budget > 0 and not preempted:
            request = self.swapped[0]
            if seats + self._num_seats(request) > self.config.max_num_seqs or not self._lora_fits(request, loras):
                break
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            extra = self.kv_cache.num_blocks_needed(request, num_new) - self.kv_cache.num_swapped_blocks(request)
            if num_new == 0 or not self.kv_cache.pool.can_allocate(
                    self.kv_cache.num_swapped_blocks(request) + max(extra, 0)):
                break
            pairs = self.kv_cache.swap_in(request)
            self.kv_cache.allocate_slots(request, num_new)
            swap_in += pairs
            self.num_swapped_in_blocks += len(pairs)
            self.swapped.popleft()
            seats += self._start_running(request, num_new, chunks)
            loras.add(request.lora_int_id)
            budget -= num_new

        passed = []   # waiting requests of adapters that cannot run now, back in front in their order
        while self.waiting and budget > 0 and not preempted and not self.swapped:
            request = self.waiting[0]
            if seats + self._num_seats(request) > self.config.max_num_seqs:
                break
            if not self._lora_fits(request, loras):
                passed.append(self.waiting.popleft())
                continue
            if request.num_computed_tokens == 0:
                self._begin_rope(request)
            hits, num_hit_tokens = ([], 0)
            # prompt logprobs need every prompt position computed, so such requests skip the cache
            wants_prompt_logprobs = getattr(request.sampling_params, "prompt_logprobs", None) is not None
            if request.num_computed_tokens == 0 and not wants_prompt_logprobs:
                hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, request.num_computed_tokens + num_hit_tokens, budget)
            if num_new == 0:
                break
            if self.kv_cache.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if hits or request.num_computed_tokens == 0:
                self.kv_cache.record_prefix_query(request.num_tokens, num_hit_tokens)
            request.num_computed_tokens += num_hit_tokens
            seats += self._start_running(request, num_new, chunks)
            loras.add(request.lora_int_id)
            budget -= num_new
        self.waiting.extendleft(reversed(passed))

        finished, self.finished = self.finished, []
        return SchedulerOutput(decodes + chunks, preempted, self.config.max_num_batched_tokens - budget,
                               swap_out, swap_in, self.kv_cache.take_pending_copies(), finished, len(decodes))

    def _begin_rope(self, request: Request) -> None:
        """The request's K/V begins from its first token: its rope length is its length now (a
        change of LongRoPE's factors since its blocks were hashed changes their hashes)."""
        num_tokens = request.num_tokens_with_placeholders
        switch = self.kv_cache.rope_switch_len
        if switch and (request.rope_len > switch) != (num_tokens > switch):
            request.block_hashes = []
        request.rope_len = num_tokens

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """The request's adapter is running already, or one more fits under max_loras."""
        lora = request.lora_int_id
        return not lora or lora in loras or len(loras) - (0 in loras) < self.config.max_loras   # 0: base, no slot

    @staticmethod
    def _num_seats(request: Request) -> int:
        """Sequences the request runs as once its pending forks (n > 1) start."""
        return 1 + len(request.pending_forks)

    def _start_running(self, request: Request, num_new: int, chunks: list[ScheduledChunk]) -> int:
        """Move a request (swapped in or admitted) to running with its first chunk; returns its seats."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new,
                                     self.kv_cache.blocks_of(request.request_id)))
        return self._num_seats(request)

    def _ends_in_flight(self, request: Request) -> bool:
        """The token a dispatched step is sampling is the request's last (max_tokens or max_model_len)."""
        return request.num_placeholders > 0 and (
            request.num_sampled_tokens >= request.max_tokens
            or request.num_tokens_with_placeholders >= self.config.max_model_len)

    def _num_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """Speculative decoding: how many of the request's proposed tokens its decode step verifies:
        as many as fit the budget, the model length and max_tokens (a step keeps at most one
        token more than it verifies)."""
        if not request.spec_token_ids or num_new != 1 or request.num_placeholders:
            return 0
        num_drafts = len(request.spec_token_ids)
        if self.kv_cache.outgrows_rope(request.rope_len, request.num_tokens + num_drafts):
            # drafts stop where a LongRoPE sequence outgrows its factors: past it, all is recomputed
            num_drafts = self.kv_cache.rope_switch_len - request.num_tokens
        return max(0, min(num_drafts, budget - 1,
                          self.config.max_model_len - request.num_tokens - 1,
                          request.max_tokens - request.num_output_tokens - 1))

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = request.num_tokens_with_placeholders - num_computed
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return 0
            num_new = budget
        return num_new

    def _preempt(self, request: Request, recompute: bool = False) -> list[tuple[int, int]]:
        """Swap the request's blocks to the host pool if configured and there is room, else drop
        them (recompute later); generated tokens are kept. Returns the swap-out pairs.
        `recompute`: drop them whatever the mode (a LongRoPE request outgrowing its factors)."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.spec_token_ids = []   # proposed for a step it will not run in
        if self.config.preemption_mode == "swap" and not recompute and self.kv_cache.can_swap_out(request):
            pairs = self.kv_cache.swap_out(request)
            self.num_swapped_out_blocks += len(pairs)
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
            return pairs
        self.kv_cache.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        return []

    # ---- after the step ------------------------------------------------------------------
    def commit(self, output: SchedulerOutput) -> None:
        """The plan is on the device: advance num_computed_tokens, and give every request that
        samples a placeholder for its coming token, so the next plan can be made before this
        step's tokens are fetched (async scheduling). n > 1: the forks sampling beside their
        parent start running now, on its blocks, each with its own placeholder."""
        if output.committed:
            return
        output.committed = True
        chunks = output.chunks
        for chunk in chunks[:output.num_plain_decodes]:   # one token each, sampled
            request = chunk.request
            request.num_computed_tokens = chunk.start + 1
            request.num_placeholders += 1
        for chunk in chunks[output.num_plain_decodes:]:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_new_tokens
            request.spec_token_ids = []
            if chunk.samples:
                request.num_placeholders += 1
            if chunk.forks and not request.is_finished:
                for child in chunk.forks:
                    self.fork(request, child)
                    child.num_placeholders = 1
                request.pending_forks = []

    def update_from_output(self, output: SchedulerOutput, result) -> "StepUpdate":
        """The step's tokens arrived: place them, decide stops, finish what stopped (freeing its
        blocks). The one place where a step changes requests after it ran.

        `result` holds, per sampled request: `requests` and `token_ids` (its first token, same
        order), and `kept` (speculative decoding: request id -> the token ids kept after the first,
        accepted drafts then the recovered or bonus token). Stops: EOS (unless ignore_eos) and
        stop_token_ids once min_tokens are out, max_tokens, max_model_len, and a grammar that admits
        no more tokens (structured outputs: each token advances the request's matcher). Stop
        strings are text: the caller finds them and calls finish_request.

        Requests finished meanwhile are skipped; requests preempted after the plan was made keep
        their token."""
        self.commit(output)
        progressed, kept_counts, stopped = [], {}, []
        max_len = self.config.max_model_len
        kept = result.kept
        drafted = {c.request.request_id: c for c in output.chunks if c.num_drafts} if kept else {}
        for index, (request, token) in enumerate(zip(result.requests, result.token_ids)):
            if request.num_placeholders == 0 or request.status in FINISHED:
                continue
            request.num_placeholders -= 1
            chunk = drafted.get(request.request_id) if drafted else None
            # speculative decoding: the drafts' slots are taken back; each token kept re-adds one
            if chunk is not None and request.num_computed_tokens == chunk.start + chunk.num_new_tokens:
                request.num_computed_tokens -= chunk.num_drafts
            output_ids, all_ids = request.output_token_ids, request.all_token_ids
            output_ids.append(token)
            all_ids.append(token)
            progressed.append((request, index))
            if (token in request.stop_token_set or len(output_ids) >= request.max_tokens or len(all_ids) >= max_len
                    or request.matcher is not None or chunk is not None):
                num_kept = self._update_one(request, kept.get(request.request_id, ()), stopped)
                if num_kept:
                    kept_counts[request.request_id] = num_kept
        return StepUpdate(progressed, kept_counts, stopped)

    def _update_one(self, request: Request, kept, stopped: list) -> int:
        """update_from_output past the plain case (a stop candidate, a grammar, drafts verified):
        the tokens kept after the first, one at a time, until one stops. Returns how many it kept."""
        num_kept = 0
        for token in kept:
            if self._stop(request, stopped):
                return num_kept
            self._accept_draft(request, token)
            num_kept += 1
        self._stop(request, stopped)
        return num_kept

    def _stop(self, request: Request, stopped: list) -> bool:
        """Decide on the request's last token: finish it (True, noted in `stopped`) or let it go on."""
        stop = token_stop(request, self.config.max_model_len)
        if request.matcher is not None:
            stop = advance_grammar(request, stop)
        if stop is None:
            return False
        status, request.stop_reason = stop
        self.finish_request(request.request_id, status)
        stopped.append((request, status, request.stop_reason))
        return True

    @staticmethod
    def _accept_draft(request: Request, token: int) -> None:
        """Speculative decoding: a verified step keeps one more token of `request` (an accepted draft,
        or the token after the last one), whose predecessor's K/V the step computed."""
        request.append_output_token(token)
        request.num_computed_tokens += 1

    def check_invariants(self) -> None:
        self.kv_cache.check_invariants()
        assert sum(map(self._num_seats, self.running)) <= self.config.max_num_seqs
        for request in self.running:
            held = len(self.kv_cache.blocks_of(request.request_id)) * self.kv_cache.block_size
            assert held >= request.num_computed_tokens, f"{request} holds too few blocks"
            assert 0 <= request.num_placeholders <= 2, f"{request} has {request.num_placeholders} placeholders"
        for request in self.waiting:
            assert request.request_id not in self.kv_cache.req_blocks or request.num_computed_tokens > 0
