"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

With async scheduling (the default) the host works one step ahead of the device:

    step():  schedule t+1  ->  dispatch t+1  ->  fetch t  ->  tokens, stops, text of t

Step t+1 is planned and its inputs built while the device still computes step t: each
request sampling in step t holds a placeholder, and step t+1 reads that token from step
t's output on the device. A request that stops at step t wastes its slot in step t+1
(that token is dropped). Nothing the next step needs waits for the host: penalty counts,
min_tokens masks and step counters live on the device (the runner's persistent batch), and
n > 1 forks start when their first token is dispatched. Steps run one at a time instead
(schedule, dispatch, fetch) only when async scheduling is off.

Structured outputs keep the overlap: a step with a constrained request dispatches only its
forward, then step t is fetched and applied (its tokens advance the grammar matchers), and
only then is step t+1's bitmask filled and its sampler queued:

    step():  schedule t+1  ->  forward t+1  ->  fetch t  ->  tokens of t  ->  mask, sample t+1
"""

import atexit
import collections
import dataclasses
import itertools
import logging
import os
import time

import jax
import numpy as np

from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.generation_config import load_generation_defaults
from jaxpaged.engine.input_processor import EmbedsSpec, InputProcessor
from jaxpaged.engine.multimodal import image_inputs
from jaxpaged.engine.metrics import PREFIX, EngineMetrics
from jaxpaged.engine.spec_decode import SpeculativeConfig, Speculator
from jaxpaged.engine.research import ResearchMixin
from jaxpaged.engine.output_processor import OutputProcessor, RequestState, SequenceState
from jaxpaged.engine.pooling import Pooling, no_pooling_params
from jaxpaged.engine.profiler import Profiler, ProfilerConfig
from jaxpaged.engine.startup import (build_draft_proposer, build_runner, build_scheduler, load_draft_model,
                                     load_model_and_tokenizer)
from jaxpaged.harmony import speaks_harmony
from jaxpaged.runner.structured_outputs import GrammarCompiler
from jaxpaged.outputs import RequestOutput
from jaxpaged.pooling_params import resolve_runner
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StepFailedError(RuntimeError):
    """A step raised; `request_ids` are the requests it aborted (the engine stays usable);
    `outputs` those of an earlier step that completed in the same call, still to be delivered."""

    def __init__(self, message: str, request_ids: list[str], outputs: list[RequestOutput] | None = None):
        super().__init__(message)
        self.request_ids = request_ids
        self.outputs = outputs or []


class LLMEngine(ResearchMixin):
    def __init__(self, args: EngineArgs, use_tqdm: bool = True, data_rank: int = 0):
        self.args = args
        self.data_rank = data_rank   # which data-parallel replica (its devices: startup.engine_devices)
        self.loaded, self.tokenizer, self.model_name = load_model_and_tokenizer(args, data_rank)
        # "auto": pooling for a bare *Model checkpoint, else generate
        runner = resolve_runner(args.runner, self.loaded.hf_config, args.pooler_config, args.speculative_config)
        if runner != args.runner:
            args = self.args = dataclasses.replace(args, runner=runner)   # (its checks run again: a pooling
            # checkpoint refuses enable_prompt_embeds here)
        self.model_config = self.loaded.config
        if args.reasoning_parser is None and self.model_config.architecture == "GptOssForCausalLM" \
                and speaks_harmony(self.tokenizer):   # vLLM's default for gpt-oss
            args = self.args = dataclasses.replace(args, reasoning_parser="openai_gptoss")
        self.paused = False            # pause_generation(): step() runs nothing
        self._weight_targets = None    # update_weights: Hugging Face name -> where it lives
        spec = SpeculativeConfig.parse(args.speculative_config)
        draft = load_draft_model(args, spec, self.loaded) if spec is not None and spec.method == "draft_model" else None
        # a vision tower is compiled before the KV cache is sized, which leaves its programs' memory free
        images = image_inputs(args, self.loaded, self.tokenizer)
        self.runner, self.max_model_len, num_blocks = build_runner(args, self.loaded, use_tqdm, draft, self.tokenizer)
        self.num_blocks = num_blocks
        source = self.loaded.source
        self.generation_defaults = load_generation_defaults(args.generation_config,
                                                            source if os.path.isdir(source) else None)
        self.eos_token_ids = self._eos_token_ids()
        self.scheduler_config, self.kv_cache, self.scheduler = build_scheduler(args, self.runner, num_blocks,
                                                                               self.max_model_len, self.model_config)
        self.metrics = EngineMetrics()
        self._rng = np.random.default_rng(args.seed)
        # runner="pooling": prompts pooled into embeddings instead of generated from (engine/pooling.py)
        self.pooling = Pooling(args.pooler_config, source if os.path.isdir(source) else None, self.loaded.hf_config,
                               self.model_config) if args.runner == "pooling" else None
        self.output_processor = OutputProcessor(self.tokenizer, self.pooling)   # what users see: text, stops
        self.profiler = Profiler(ProfilerConfig.parse(args.profiler_config))   # start_profile / stop_profile
        # step(defer_outputs=True), AsyncLLM's: completed steps wait in take_completed() for its output
        # thread, which builds their outputs off the loop that schedules and launches steps
        self._defer_outputs = False
        self._completed: list[tuple] = []   # (plan, update, result) of completed steps, outputs not built
        self._in_flight = collections.deque()           # (plan, pending) dispatched, not fetched, oldest first
        self._ids = itertools.count()
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,   # structured outputs
                                        args.reasoning_parser)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                              args.max_logprobs, self.scheduler.check_prompt_len,
                                              args.scheduling_policy,
                                              EmbedsSpec(self.model_config.hidden_size, self.runner.embeds_dtype,
                                                         args.block_size) if args.enable_prompt_embeds else None,
                                              *images)
        self.speculator = Speculator(spec, self.max_model_len) if spec is not None else None
        if draft is not None:
            self.speculator.use_draft_model(build_draft_proposer(args, draft, num_blocks, self.max_model_len, use_tqdm))
        self.lora = None   # multi-LoRA (enable_lora): the adapters and their device slots
        if args.enable_lora:
            from jaxpaged.lora.manager import LoRAManager
            self.lora = LoRAManager(self.runner.state, self.model_config, args.max_loras, args.max_lora_rank,
                                    self.loaded.model.dtype, args.max_cpu_loras)
            if args.compile_on_startup:
                self.lora.warm_up()
        if self.runner.channel is not None and self.runner.channel.is_leader:
            atexit.register(self.shutdown)   # followers must not wait forever for a step

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids) | set(self.generation_defaults.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        return tuple(sorted(ids))

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    lora_request=None, priority: int = 0, pooling_params=None) -> str:
        """Validate and queue a request; raises ValueError (and queues nothing) on bad input.
        `lora_request`: a LoRARequest (the engine needs enable_lora), read from its folder now.
        `priority` (scheduling_policy="priority"): the lower, the sooner it runs; else it must be 0.
        `pooling_params` (runner="pooling", which takes no `params`): the prompt is pooled, not generated from."""
        if self.runner.is_sleeping:
            raise ValueError("the engine is sleeping: call wake_up() before adding requests")
        if self.pooling is not None:
            params, pooling_params = self.pooling.request_params(params, pooling_params)
        else:
            no_pooling_params(pooling_params)
            params = params or SamplingParams()
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
            params = self.generation_defaults.apply(params)
            if self.runner.logits_processors is not None:   # custom ones: their arguments (extra_args)
                self.runner.logits_processors.validate_params(params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        priority = self.input_processor.check_priority(priority)
        processed = self.input_processor.process(prompt, params)
        text, token_ids = processed.text, processed.token_ids
        cache_salt = self._add_lora(lora_request, processed.cache_salt)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        core_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        clash = [c for c in core_ids if c in self.output_processor.seqs or c in self.scheduler.requests]
        if clash:
            raise ValueError(f"request_id {request_id!r} clashes with the sequence id {clash[0]!r} of a request "
                             "in flight (sequences of n > 1 requests are named '<id>#<index>')")
        so = params.structured_outputs
        matchers = [self.grammars.matcher(so, [] if processed.embeds is not None else token_ids)
                    if so is not None else None for _ in core_ids]
        sequences = []
        for i, core_id in enumerate(core_ids):
            seed = self._seed_for(params, i)
            request = Request(core_id, token_ids, params, self.eos_token_ids, arrival_time, seed, max_tokens,
                              cache_salt, lora_request, priority, processed.embeds, processed.embeds_digests,
                              processed.image_rows, processed.mrope)
            request.constrain(matchers[i], processed.bad_words_token_ids)
            sequences.append(SequenceState(request, i, self.tokenizer, request_id))
        embeds = processed.embeds is not None   # a prompt of embeddings: no prompt token ids to show
        state = RequestState(request_id, text, None if embeds else token_ids, sequences, lora_request,
                             len(token_ids) if embeds else 0)
        state.pooling_params = pooling_params
        # n > 1: one sequence prefills; the others fork off it (sharing its blocks) when it samples
        parent = sequences[0].request
        parent.pending_forks = [seq.request for seq in sequences[1:]]
        self.scheduler.add_request(parent)
        self.output_processor.add(state)
        self.metrics.prompt_tokens_total += len(token_ids)
        return request_id

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return int(self._rng.integers(0, 2**32))
        return (params.seed + 0x9E3779B9 * index) & 0xFFFFFFFF

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its blocks at once (unknown ids are ignored)."""
        state = self.output_processor.abort(request_id)
        if state is None:
            return
        for seq in state.sequences:
            self.scheduler.finish_request(seq.request.request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # ---- the loop ------------------------------------------------------------------------
    def step(self, defer_outputs: bool = False) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that progressed, as each request's
        output_kind asks (CUMULATIVE: everything so far; DELTA: what is new; FINAL_ONLY: at the end).

        With async scheduling the outputs are those of the previous device step, whose
        tokens are fetched while this call's step runs. `defer_outputs`: build none; the steps
        completed wait in take_completed() for another thread's output_processor (AsyncLLM).
        """
        self._defer_outputs = defer_outputs
        try:
            return self._step()
        finally:
            self._defer_outputs = False

    def _step(self) -> list[RequestOutput]:
        if self.paused:
            return []
        if self.runner.is_sleeping:
            raise RuntimeError("the engine is sleeping: call wake_up() before generating")
        overlap = self.args.async_scheduling
        spec = self.speculator
        # speculative decoding: proposals need every token, so a step that proposes fetches all first
        proposing = spec is not None and spec.wants_tokens(self.scheduler.running)
        outputs = []
        while len(self._in_flight) > (1 if overlap and not proposing else 0):   # at most one step unfetched
            outputs += self._complete()
        if proposing:
            spec.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        verifies = False
        if spec is not None:
            verifies = any(chunk.num_drafts for chunk in plan.chunks)
            spec.end_step()
        self.metrics.num_preemptions_total += len(plan.preempted)
        self.metrics.swapped_out_blocks_total += len(plan.swap_out)
        self.metrics.swapped_in_blocks_total += len(plan.swap_in)
        if not plan.is_empty:
            prev = self._in_flight[-1][1] if self._in_flight else None
            try:
                if verifies and spec.drafter is not None:
                    spec.drafter.fill(plan)
                self.assign_loras(plan)
                plan.dispatched_at = time.perf_counter()
                pending = self.runner.dispatch(plan, prev)
            except Exception as exc:
                error = self._fail_steps([plan], exc)
                error.outputs = outputs
                raise error from exc
            self.scheduler.commit(plan)
            self._in_flight.append((plan, pending))
            if not pending.is_sampled:   # a constrained row: its mask needs the step in flight applied
                while len(self._in_flight) > 1:
                    outputs += self._complete()
                try:
                    self.runner.sample(pending)
                except Exception as exc:
                    self._in_flight.clear()
                    error = self._fail_steps([plan], exc)
                    error.outputs = outputs   # step t's, applied above: its finished requests are done
                    raise error from exc
        else:
            self.runner.run_without_step(plan)
        if self.runner.host_cache is not None and self.runner.host_cache.failed_batches:
            self.scheduler.loads_failed(*self.runner.host_cache.take_failed())
        # with overlap, step t's tokens while step t+1 runs; else this step's own (and a verifying
        # step's: the next proposals need its tokens)
        while len(self._in_flight) > (1 if overlap and not plan.is_empty and not verifies else 0):
            outputs += self._complete()
        return outputs

    def _complete(self) -> list[RequestOutput]:
        """Fetch the oldest step in flight, let the scheduler place its tokens and decide its stops
        (`update_from_output`), and build the outputs.

        An interrupted fetch (Ctrl-C) leaves the step queued, for the next call to fetch again;
        a failed one drops it (its requests fail with the caller, who aborts them).
        """
        plan, pending = self._in_flight[0]
        try:
            result = self.runner.fetch(pending)
        except Exception as exc:
            # every later step in flight took its input tokens from this one's output
            plans = [p for p, _ in self._in_flight]
            self._in_flight.clear()
            raise self._fail_steps(plans, exc) from exc
        self._in_flight.popleft()
        self.scheduler.cost.observe_step(plan.num_batched_tokens - plan.num_plain_decodes,
                                         time.perf_counter() - plan.dispatched_at)
        update = self.scheduler.update_from_output(plan, result)
        if self.pooling is None:   # (a pooled prompt's sampled token is dropped)
            self.metrics.generation_tokens_total += update.num_tokens
        for rid, num_drafts in result.num_drafts.items():
            self.speculator.observe(rid, num_drafts, len(result.kept[rid]))
        if self._defer_outputs:
            self._completed.append((plan, update, result))
            return []
        return self._outputs([(plan, update, result)])

    def take_completed(self) -> list[tuple]:
        """step(defer_outputs=True): the steps completed since the last call, oldest first, for
        `output_processor.process` (on any one thread) and then `finish_stopped` (on this one)."""
        steps, self._completed = self._completed, []
        return steps

    def finish_stopped(self, requests) -> None:
        """Finish the requests a stop string ended (the output side found it), unless gone since."""
        for request in requests:
            if self.scheduler.requests.get(request.request_id) is request:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def has_work(self) -> bool:
        """Requests the core still runs, or steps in flight (their outputs aside)."""
        return bool(self.scheduler.requests) or bool(self._in_flight)

    def release(self, request_id: str) -> None:
        """A request's last output was delivered (a data-parallel engine forgets where it ran)."""

    def _fail_steps(self, plans: list, cause: Exception) -> "StepFailedError":
        """Undo what failed steps leave behind; returns the error to raise.

        Their requests are aborted: tokens they were sampling are lost and their K/V may be half
        written. So are requests swapped out by those steps (the copy to the host may not have
        run). Every block the steps touched leaves the prefix cache: a block registered when
        it was planned would otherwise hand unwritten K/V to the next request with that prefix.
        Dropping a valid entry costs only a cache hit.
        """
        failed: dict[str, None] = {}
        touched: list[int] = []
        for plan in plans:
            for chunk in plan.chunks:
                touched += chunk.block_ids
                for request in (chunk.request, *chunk.forks):
                    failed[request.request_id] = None
            for request in plan.preempted:
                if request.status == RequestStatus.SWAPPED:
                    failed[request.request_id] = None
            touched += [dst for _, dst in plan.swap_in] + [dst for _, dst in plan.copies]
        seqs = [self.output_processor.seqs.get(rid) for rid in failed]
        request_ids = list(dict.fromkeys(seq.parent_id for seq in seqs if seq is not None))
        for request_id in request_ids:
            self.abort_request(request_id)
        self.kv_cache.forget_cached_blocks(touched)
        logger.error("engine step failed (%s: %s); aborted %d request(s): %s", type(cause).__name__, cause,
                     len(request_ids), request_ids)
        return StepFailedError(f"engine step failed: {type(cause).__name__}: {cause}", request_ids)

    def _outputs(self, steps) -> list[RequestOutput]:
        """The outputs of completed steps (OutputProcessor); requests a stop string ended finish."""
        outputs, stopped = self.output_processor.process(steps)
        self.finish_stopped(stopped)
        return outputs

    # ---- introspection -------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        out = self.metrics.snapshot(self.scheduler, self.kv_cache, self.output_processor)
        if self.speculator is not None:
            out.update({PREFIX + k: v for k, v in self.speculator.metrics().items()})
        return out

    # ---- several hosts ----------------------------------------------------------------------
    @property
    def is_follower(self) -> bool:
        """A rank other than 0 of a multi-host engine: it runs rank 0's steps (`follow`), nothing else."""
        return self.runner.channel is not None and not self.runner.channel.is_leader

    def follow(self) -> int:
        """Run rank 0's steps until it shuts down; returns how many ran."""
        logger.info("rank %d follows rank 0's steps", jax.process_index())
        steps = self.runner.follow()
        logger.info("rank 0 stopped after %d steps", steps)
        return steps

    def shutdown(self) -> None:
        """Rank 0 of several hosts: release the followers (their follow() returns). Idempotent."""
        self.runner.stop_followers()

    def get_metrics_per_rank(self) -> list[dict[str, float]]:
        """One dict per data-parallel replica (this engine is the only one)."""
        return [self.get_metrics()]

    def replicas(self) -> list["LLMEngine"]:
        """The engines that run steps (a DataParallelEngine has one per data-parallel rank)."""
        return [self]

    def get_tokenizer(self):
        return self.tokenizer
