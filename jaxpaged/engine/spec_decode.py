"""Speculative decoding: proposals on the host, verification inside the ordinary step.

    speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                        "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    speculative_config={"model": DRAFT, "num_speculative_tokens": 4}      (method "draft_model")

Before a step, the proposer gives each running decode request up to k tokens that may follow
its last one (`Request.spec_token_ids`). The scheduler plans the request's chunk as its last
token plus those drafts; the step computes all k + 1 positions like any prompt chunk and its
sampler verifies draft j in row j (sampler.sample: greedy rows accept the argmax, random rows
accept with probability p(draft), the proposal being one-hot, and otherwise draw from p without
the draft), so the request keeps its accepted drafts plus one more token, distributed exactly as
without speculation. Rejected drafts' K/V slots are overwritten by later steps; only blocks of
kept tokens are ever hashed into the prefix cache.

A verifying step is fetched before the next is planned (its proposals need its tokens), so
speculation gives up async scheduling's overlap while it runs. Each request backs off when its
proposals miss (no n-gram match, or no draft accepted): it is proposed for only every 2, 4 ...
2**MAX_BACKOFF steps, aligned across requests, so a workload speculation cannot help runs
asynchronously, as without it, almost all the time.

Requests whose sampling reads device state the drafts would have to update (penalties,
logit_bias, allowed_token_ids, bad_words, min_tokens not yet reached, structured outputs) are never
proposed for: they decode as without speculation. Beam search and speculation together are refused.
"""

import dataclasses

import numpy as np

from jaxpaged.runner.sampler import uses_bias_row, uses_output_tokens

MAX_BACKOFF = 4   # a request that keeps missing is proposed for every 2**MAX_BACKOFF steps
METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4        # ngram: the longest suffix looked up in the context
    prompt_lookup_min: int = 1        # ngram: the shortest
    model: str | None = None          # draft_model: a checkpoint with the target's tokenizer

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a dict with vLLM's keys, a JSON string of one (the CLI's), or a SpeculativeConfig."""
        if value is None or isinstance(value, cls):
            return value
        from jaxpaged.engine.arg_utils import json_config
        value = json_config("speculative_config", value, [f.name for f in dataclasses.fields(cls)])
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else "ngram"
        return cls(**value)

    def __post_init__(self):
        def require(name, ok, allowed):
            if not ok:
                raise ValueError(f"speculative_config {name} must be {allowed}, got {getattr(self, name)!r}")

        require("method", self.method in METHODS, f"one of {', '.join(map(repr, METHODS))}")
        k = self.num_speculative_tokens
        require("num_speculative_tokens", isinstance(k, int) and 1 <= k <= 16, "an int in [1, 16]")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            require(name, isinstance(getattr(self, name), int) and getattr(self, name) >= 1, "an int >= 1")
        require("prompt_lookup_min", self.prompt_lookup_min <= self.prompt_lookup_max,
                f"<= prompt_lookup_max ({self.prompt_lookup_max})")
        require("model", (self.model is not None) == (self.method == "draft_model"),
                "a checkpoint (hub id, folder or .gguf) for method 'draft_model', and absent for 'ngram'")


def ngram_proposal(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: find the longest suffix of `tokens` (n_max down to n_min tokens) that occurred
    earlier, most recent occurrence first, and propose the (up to k) tokens that followed it."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        starts = L - n   # candidate occurrences start at 0 .. L - n - 1 (the suffix itself excluded)
        match = np.ones(starts, bool)
        for i in range(n):
            match &= tokens[i:i + starts] == tokens[L - n + i]
        hits = np.flatnonzero(match)
        if hits.size:
            s = int(hits[-1]) + n
            return tokens[s:s + k].tolist()
    return []


@dataclasses.dataclass
class _Backoff:
    level: int = 0        # proposed for every 2**level steps
    due: int = 0          # the next step it is proposed for


def eligible(request) -> bool:
    """Whether drafts may be verified for `request` without changing its distribution (its sampling
    reads no per-step device state that the drafts would have to advance)."""
    p = request.sampling_params
    return (not request.needs_host_mask and not uses_bias_row(request) and not uses_output_tokens(p)
            and request.num_output_tokens >= p.min_tokens)


class Speculator:
    """The engine's proposer and its bookkeeping: which requests to propose for, and the
    acceptance counters (vLLM's spec_decode metrics)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.step = 0
        self._backoff: dict[str, _Backoff] = {}
        self.num_drafts = 0           # verifications (a request's drafts in one step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        # (request, at most k) -> draft tokens; tests may put any proposer here
        self.proposer = self.ngram
        self.drafter: DraftModelProposer | None = None   # draft_model: fills the reserved drafts

    def use_draft_model(self, drafter: "DraftModelProposer") -> None:
        """method "draft_model": proposals reserve k slots; the drafter fills them once planned."""
        self.drafter = drafter
        self.proposer = lambda request, k: [0] * k

    def ngram(self, request, k: int) -> list[int]:
        cfg = self.config
        return ngram_proposal(np.asarray(request.all_token_ids, np.int64), k, cfg.prompt_lookup_min,
                              cfg.prompt_lookup_max)

    def _candidates(self, running) -> list:
        return [r for r in running if r.num_placeholders == 0 and r.num_output_tokens > 0
                and r.num_computed_tokens == r.num_tokens - 1 and eligible(r)]

    def wants_tokens(self, running) -> bool:
        """Whether this step proposes for some request (the engine then fetches every step in flight
        first, so that their tokens are known)."""
        return any(self._state(r).due <= self.step and self._room(r) > 0
                   for r in running if eligible(r) and r.num_output_tokens > 0)

    def _room(self, request) -> int:
        """How many drafts the request's next step may verify (max_model_len, max_tokens)."""
        return min(self.config.num_speculative_tokens, self.max_model_len - request.num_tokens - 1,
                   request.max_tokens - request.num_output_tokens - 1)

    def _state(self, request) -> _Backoff:
        state = self._backoff.get(request.request_id)
        if state is None:
            state = self._backoff[request.request_id] = _Backoff(due=self.step)
        return state

    def propose(self, running) -> None:
        """Set spec_token_ids of every due request that decodes this step (changes them)."""
        if len(self._backoff) > 2 * len(running) + 64:   # finished requests' entries
            ids = {r.request_id for r in running}
            self._backoff = {rid: s for rid, s in self._backoff.items() if rid in ids}
        for request in self._candidates(running):
            state = self._state(request)
            if state.due > self.step:
                continue
            room = self._room(request)
            if room <= 0:
                continue
            drafts = self.proposer(request, room)
            request.spec_token_ids = drafts
            if not drafts:
                self._missed(state)

    def end_step(self) -> None:
        self.step += 1

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: counters, and the request's backoff."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
        state = self._backoff.get(request_id)
        if state is None:
            return
        if num_accepted:
            state.level, state.due = 0, self.step   # due at once: the next step proposes again
        else:
            self._missed(state)

    def _missed(self, state: _Backoff) -> None:
        state.level = min(state.level + 1, MAX_BACKOFF)
        period = 1 << state.level
        # at least a period away, on a multiple of it: backed-off requests come due in the same steps
        state.due = -(-(self.step + period) // period) * period

    def metrics(self) -> dict[str, float]:
        out = {"spec_decode_num_drafts_total": self.num_drafts,
               "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
               "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens}
        for j, n in enumerate(self.accepted_per_pos):
            out[f'spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}'] = n
        return out


# ---- draft model ----------------------------------------------------------------------------
class _DraftSequence:
    """What the draft model's runner sees of a target request: the same tokens and block table,
    greedy sampling, and its own count of the tokens whose K/V the draft pool holds."""

    def __init__(self, request, greedy_params):
        self.target = request
        self.request_id = request.request_id
        self.sampling_params = greedy_params
        self.seed = 0
        self.eos_token_ids = ()
        self.matcher = None
        self.needs_host_mask = False
        self.custom_logits = False   # (no custom logits processors run beside speculation)
        self.banned_token_ids = ()
        self.pending_forks = []
        self.lora_slot = -1   # the draft model runs without adapters
        self.num_embeds_tokens = 0   # prompt embeddings are refused with speculative decoding
        self.embed_ranges, self.embeds_end = (), 0   # a target's images: the draft model reads their tokens
        self.mrope_offsets, self.mrope_delta = None, 0   # ... and turns plain positions
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = []
        self.num_placeholders = 0
        self.spec_token_ids: list[int] = []   # the draft model does not speculate itself
        self.num_computed_tokens = 0      # of the draft pool
        self.context_len = 0              # the target's tokens when the last drafts were made
        self.preemptions = request.num_preemptions   # a preempted target's blocks were reused meanwhile
        self.block_ids: list[int] = []    # the table those K/V were written under

    @property
    def is_finished(self) -> bool:
        return self.target.is_finished or self.target.num_computed_tokens == 0   # finished or preempted

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_sampled_tokens(self) -> int:
        return 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def rope_len(self) -> int:
        """The target's: a recompute of the target (LongRoPE outgrown) ends this sequence too."""
        return self.target.rope_len


class DraftModelProposer:
    """method "draft_model": a smaller model with the target's vocabulary runs k greedy steps per
    verification, with its own KV pool indexed by the target's block ids (so it needs no blocks of
    its own: the target's step reserves the slots its drafts fill). Greedy drafts are one-hot
    proposals, verified exactly as prompt lookup's.

    The draft pool is written only by draft steps: a request's draft K/V is recomputed from the
    first block whose id changed (copy-on-write, swap) and from scratch after a preemption."""

    def __init__(self, runner, block_size: int):
        from jaxpaged.sampling_params import SamplingParams
        self.runner = runner
        self.block_size = block_size
        self.greedy = SamplingParams(temperature=0.0)
        self._seqs: dict[str, _DraftSequence] = {}
        self._released: list[_DraftSequence] = []   # to free their runner slots in the next draft step

    def _sequence(self, request) -> _DraftSequence:
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.target is not request or seq.is_finished or seq.preemptions != request.num_preemptions:
            if seq is not None:
                self._released.append(seq)
            seq = self._seqs[request.request_id] = _DraftSequence(request, self.greedy)
        return seq

    def fill(self, plan) -> None:
        """Write the drafts of every verifying chunk of `plan` into its request's spec_token_ids."""
        from jaxpaged.core.scheduler import ScheduledChunk, SchedulerOutput

        # sequences of finished or preempted targets give their runner slots back in the next draft step
        # (a preempted target gets a fresh sequence when it verifies again)
        for rid, seq in list(self._seqs.items()):
            if seq.is_finished:
                self._released.append(seq)
                del self._seqs[rid]
        work = []
        for chunk in plan.chunks:
            if not chunk.num_drafts:
                continue
            request = chunk.request
            seq = self._sequence(request)
            # K/V under block ids that changed since they were written, or of drafts the target did
            # not keep, must be recomputed
            valid = min(seq.num_computed_tokens, request.num_tokens - 1)
            for j, (old, new) in enumerate(zip(seq.block_ids, chunk.block_ids)):
                if old != new:
                    valid = min(valid, j * self.block_size)
                    break
            old_tokens, tokens = seq.all_token_ids, request.all_token_ids
            for j in range(min(seq.context_len, valid), valid):
                if old_tokens[j] != tokens[j]:
                    valid = j
                    break
            seq.num_computed_tokens = valid
            seq.block_ids = list(chunk.block_ids)
            seq.all_token_ids = list(tokens)
            seq.context_len = len(tokens)
            work.append((seq, chunk.num_drafts, []))
        budget = self.runner.max_num_batched_tokens
        while work:
            chunks, left = [], budget
            for seq, _, _ in work:
                n = min(len(seq.all_token_ids) - seq.num_computed_tokens, left)
                if n <= 0:
                    continue
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n, seq.block_ids))
                left -= n
            plan_d = SchedulerOutput(chunks, [], budget - left, finished=self._released)
            self._released = []
            result = self.runner.fetch(self.runner.dispatch(plan_d))
            for chunk in chunks:
                chunk.request.num_computed_tokens += chunk.num_new_tokens
            for seq, k, drafts in work:
                token = result.sampled.get(seq.request_id)
                if token is not None and seq.num_computed_tokens == len(seq.all_token_ids):
                    drafts.append(token.token_id)
                    seq.all_token_ids.append(token.token_id)
            for seq, k, drafts in work:
                if len(drafts) == k:
                    seq.target.spec_token_ids = drafts
                    # the last draft's K/V is not written: it is the next step's first input, or rejected
                    seq.all_token_ids.pop()
            work = [w for w in work if len(w[2]) < w[1]]
