"""Continuous batching: decide, each step, which requests compute how many tokens.

One token budget per step (`max_num_batched_tokens`); running requests first, in order,
then waiting requests in the policy's order. A step freely mixes decodes (1 token), whole
prompts and (with chunked prefill) prompt chunks. When the pool runs out of blocks the
last running request is preempted: its blocks are freed (recompute) or swapped out, and it
goes back to the waiting (or swapped) queue, keeping the tokens it generated.

The policy (vLLM's `scheduling_policy`, request_queue.py) orders the queues and the running list.
"fcfs": arrival order, the newest running request preempted first, a preempted one back in front.
"priority": by (priority, arrival time), the running list too, so that the request preempted is
the one of the highest key, and a waiting request that outranks all those swapped out is admitted
before them. As in vLLM, a waiting request never preempts a running one: it waits for free blocks.

LongRoPE (Phi-3) encodes every position with other factors once a sequence is longer than
the model's original length, and transformers then recomputes the sequence's whole cache.
So does this scheduler: a request whose K/V began shorter than that length is preempted by
recompute when it outgrows it (once), and its K/V is computed anew with the long factors.

Only host state changes here: the plan goes out as a `SchedulerOutput`.
"""

import bisect

from jaxpaged.core.kv_cache_manager import KVCacheManager, cdiv
from jaxpaged.core.preemption import PreemptionCost
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.request_queue import make_queue, priority_key
from jaxpaged.core.sched_config import SchedulerConfig
from jaxpaged.core.sched_output import PlainDecode, ScheduledChunk, SchedulerOutput, StepUpdate
from jaxpaged.core.sched_update import StepUpdates

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StepUpdate"]


class Scheduler(StepUpdates):
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, cost: PreemptionCost | None = None):
        self.config = config
        self.kv_cache = kv_cache
        self.cost = cost or PreemptionCost(block_bytes=0)   # preemption_mode="auto": swap or recompute
        self.by_priority = config.policy == "priority"
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []    # "priority": sorted by priority_key
        self.swapped = make_queue(config.policy)
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []      # finished since the last plan (it hands them to the runner)
        self.loaded: list[Request] = []        # waiting with blocks the last plan loads from the host tier
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
        self.waiting.add(request)

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
        self._run(child)

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

        # The common case first, in one tight pass: a plain decode (one new token, not a prompt embedding;
        # no drafts, forks to start or LongRoPE) inside a block it holds alone, neither starting nor filling
        # a block: nothing to allocate, share or register. Every other request takes the general path below.
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
                    and not request.pending_forks and start >= request.embeds_end):
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
        # swapped requests come back before any new request is admitted ("priority": one that outranks them)
        while self.swapped and budget > 0 and not preempted:
            request = self.swapped.peek()
            if self.waiting and self._outranks_swapped(self.waiting.peek()):
                break
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
            self.swapped.pop()
            seats += self._start_running(request, num_new, chunks)
            loras.add(request.lora_int_id)
            budget -= num_new

        passed = []   # waiting requests of adapters that cannot run now, back in front in their order
        loading = []  # admitted with host-tier hits: they compute from the next step, once loaded
        while self.waiting and budget > 0 and not preempted:
            request = self.waiting.peek()
            if seats + self._num_seats(request) > self.config.max_num_seqs or not self._outranks_swapped(request):
                break
            if not self._lora_fits(request, loras):
                passed.append(self.waiting.pop())
                continue
            hits, host_hits, num_hit_tokens = [], [], 0
            first = request.num_computed_tokens == 0   # else loaded from the host tier last step
            if first:
                self._begin_rope(request)
                # prompt logprobs need every prompt position computed, so such requests skip the cache
                if getattr(request.sampling_params, "prompt_logprobs", None) is None:
                    hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
                    host_hits = self.kv_cache.get_host_blocks(request, len(hits))
            if host_hits:   # loaded after this step's forward: the request computes from the next step
                if not self.kv_cache.begin_load(request, hits, host_hits):
                    break
                self._record_lookup(request, num_hit_tokens, len(host_hits) * bs)
                request.num_computed_tokens = num_hit_tokens + len(host_hits) * bs
                loading.append(self.waiting.pop())
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens + num_hit_tokens, budget)
            if num_new == 0:
                break
            if self.kv_cache.allocate_slots(request, num_new, hits) is None:
                if not first:   # loaded, and no room to go on: its blocks join the device cache
                    self._unload(request, landed=True)
                break
            self.waiting.pop()
            if first:
                self._record_lookup(request, num_hit_tokens, 0)
            request.num_computed_tokens += num_hit_tokens
            seats += self._start_running(request, num_new, chunks)
            loras.add(request.lora_int_id)
            budget -= num_new
        self.waiting.prepend_all(passed)
        self.waiting.prepend_all(loading)
        # loaded for the last plan but not admitted in this one (a request in front could not run, or
        # no room): their blocks go to the device cache instead of being held while others wait
        for request in self.loaded:
            if request.status == RequestStatus.WAITING and request.num_computed_tokens:
                self._unload(request, landed=True)
        self.loaded = loading

        finished, self.finished = self.finished, []
        return SchedulerOutput(decodes + chunks, preempted, self.config.max_num_batched_tokens - budget,
                               swap_out, swap_in, self.kv_cache.take_pending_copies(), finished, len(decodes),
                               host=self.kv_cache.take_host_moves())

    def loads_failed(self, blocks: set[int], batches: set[int]) -> None:
        """Host-tier loads into these device blocks failed: the requests waiting on them recompute
        (their blocks go back unregistered), and the tier forgets those batches."""
        for request in self.loaded:
            held = self.kv_cache.blocks_of(request.request_id)
            if request.status == RequestStatus.WAITING and blocks.intersection(held):
                self._unload(request, landed=False)
        self.kv_cache.host_cache.forget(batches)

    def _unload(self, request: Request, landed: bool) -> None:
        """A waiting request lets its loaded blocks go and will compute from its first token: into the
        device cache if their K/V landed, else unregistered."""
        if landed:
            self.kv_cache.release_loaded(request)
        else:
            self.kv_cache.free(request)
        request.num_computed_tokens = 0

    def _record_lookup(self, request: Request, num_hit_tokens: int, num_host_tokens: int) -> None:
        """An admission's prefix-cache lookup (device, then host tier): counters, num_cached_tokens."""
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens + num_host_tokens
        self.kv_cache.record_prefix_query(request.num_tokens, num_hit_tokens)
        if self.kv_cache.host_cache is not None:
            self.kv_cache.host_cache.record_query(request.num_tokens - num_hit_tokens, num_host_tokens)

    def _begin_rope(self, request: Request) -> None:
        """The request's K/V begins from its first token: its rope length is its length now (a
        change of LongRoPE's factors since its blocks were hashed changes their hashes)."""
        num_tokens = request.num_tokens_with_placeholders
        switch = self.kv_cache.rope_switch_len
        if switch and (request.rope_len > switch) != (num_tokens > switch):
            request.block_hashes = []
        request.rope_len = num_tokens

    def _outranks_swapped(self, request: Request) -> bool:
        """A waiting request may be admitted: nothing is swapped out, or ("priority") it outranks all
        that is. Swapped requests otherwise come back first (their K/V is kept on the host)."""
        return not self.swapped or (self.by_priority and priority_key(request) < priority_key(self.swapped.peek()))

    def _run(self, request: Request) -> None:
        """Into the running list: last ("fcfs"), or after those of its key or less ("priority")."""
        if self.by_priority:
            bisect.insort_right(self.running, request, key=priority_key)
        else:
            self.running.append(request)

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
        self._run(request)
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
        """Swap the request's blocks to the host pool if configured (or cheaper, in "auto") and there is
        room, else drop them (recompute later); generated tokens are kept. Returns the swap-out pairs.
        `recompute`: drop them whatever the mode (a LongRoPE request outgrowing its factors)."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.spec_token_ids = []   # proposed for a step it will not run in
        mode = self.config.preemption_mode
        swap = not recompute and mode != "recompute" and self.kv_cache.can_swap_out(request) and (
            mode == "swap" or self.cost.prefers_swap(len(self.kv_cache.blocks_of(request.request_id)),
                                                     request.num_computed_tokens))
        if swap:
            pairs = self.kv_cache.swap_out(request)
            self.num_swapped_out_blocks += len(pairs)
            request.status = RequestStatus.SWAPPED
            self.swapped.prepend(request)
            return pairs
        self.kv_cache.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.prepend(request)
        return []

    def check_invariants(self) -> None:
        self.kv_cache.check_invariants()
        assert sum(map(self._num_seats, self.running)) <= self.config.max_num_seqs
        if self.by_priority:
            keys = list(map(priority_key, self.running))
            assert keys == sorted(keys), "the running list is out of priority order"
        for request in self.running:
            held = len(self.kv_cache.blocks_of(request.request_id)) * self.kv_cache.block_size
            assert held >= request.num_computed_tokens, f"{request} holds too few blocks"
            assert 0 <= request.num_placeholders <= 2, f"{request} has {request.num_placeholders} placeholders"
        for request in self.waiting:
            assert request.request_id not in self.kv_cache.req_blocks or request.num_computed_tokens > 0
