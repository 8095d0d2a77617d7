"""Data parallelism: several model replicas, each with its own batch, KV cache and scheduler.

`DataParallelEngine` holds `data_parallel_size` LLMEngines; replica r runs on devices
[r * tp, (r + 1) * tp) (its own tensor-parallel mesh, `startup.engine_devices`). It offers the
LLMEngine interface that `LLM` and `AsyncLLM` use, so either front end serves a data-parallel
engine unchanged.

- A new request goes to the replica whose prefix cache already holds the longest part of its
  prompt; with no hit anywhere (or a tie), to the one with the fewest unfinished requests.
  All sequences of a request (n > 1) stay on its replica.
- `step()` steps every replica in turn. With async scheduling (the default) each replica's
  step returns once its next step is queued, so the replicas' devices run together; without it
  they run one after another.
- Metrics: `get_metrics()` sums the replicas' counters and gauges (cache usage: the mean);
  `get_metrics_per_rank()` gives each replica's own.
"""

import itertools
import logging

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine, StepFailedError
from jaxpaged.engine.metrics import PREFIX
from jaxpaged.lora.request import lora_cache_salt
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MEAN_METRICS = {PREFIX + "kv_cache_usage_perc"}   # averaged over replicas instead of summed


def make_engine(args: EngineArgs, use_tqdm: bool = True):
    """An LLMEngine, or a DataParallelEngine when args.data_parallel_size > 1."""
    if args.data_parallel_size > 1:
        return DataParallelEngine(args, use_tqdm)
    return LLMEngine(args, use_tqdm=use_tqdm)


class DataParallelEngine:
    def __init__(self, args: EngineArgs, use_tqdm: bool = True):
        self.engines = [LLMEngine(args, use_tqdm=use_tqdm, data_rank=r) for r in range(args.data_parallel_size)]
        first = self.engines[0]
        self.args = first.args   # with what the replicas resolved (runner, reasoning_parser)
        self.model_config = first.model_config
        self.max_model_len = first.max_model_len
        self.num_blocks = first.num_blocks          # per replica
        self.tokenizer = first.tokenizer
        self.model_name = first.model_name
        self.generation_defaults = first.generation_defaults
        self.eos_token_ids = first.eos_token_ids
        self.pooling = first.pooling                # runner="pooling": every replica pools
        self.profiler = first.profiler              # one trace per process (jax.profiler), of every replica
        self._owner: dict[str, LLMEngine] = {}      # request id -> its replica
        self._ids = itertools.count()
        self._held: list[RequestOutput] = []        # outputs of a step round in which a replica failed

    def replicas(self) -> list[LLMEngine]:
        return list(self.engines)

    # ---- requests ------------------------------------------------------------------------
    def route(self, token_ids: list[int], cache_salt: str | None = None,
              embeds_digests: tuple[bytes, ...] = ()) -> LLMEngine:
        """The replica for a prompt: the longest prefix-cache hit (device and host tier), then the fewest
        unfinished requests. `embeds_digests`: a prompt of embeddings' (its token ids are placeholders)."""
        hits = [e.kv_cache.cached_prefix_tokens(token_ids, cache_salt, embeds_digests) for e in self.engines]
        best = max(hits)
        candidates = [e for e, hit in zip(self.engines, hits) if hit == best]
        return min(candidates, key=lambda e: (e.get_num_unfinished_requests(), e.data_rank))

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request=None, priority: int = 0,
                    pooling_params=None) -> str:
        first = self.engines[0]
        processor = first.input_processor   # ValueError on a bad prompt, before anything is queued
        salt = processor.cache_salt(prompt)
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:   # routed by its blocks' row digests too
            processed = processor.process(prompt, params or SamplingParams())
            token_ids, digests = processed.token_ids, processed.embeds_digests
            forwarded = {"prompt_embeds": processed.embeds}
        elif isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            # images: routed by their prompt's text; the replica's own tower makes (and checks) their rows
            token_ids = processor.tokenize({**prompt, "multi_modal_data": None})[1]
            digests, forwarded = (), dict(prompt)
        else:
            text, token_ids = processor.tokenize(prompt)
            asks = pooling_params if pooling_params is not None else params   # either carries truncate_prompt_tokens
            token_ids = processor.truncate(token_ids, getattr(asks, "truncate_prompt_tokens", None))
            digests, forwarded = (), {"prompt_token_ids": token_ids}
            if text is not None:
                forwarded["prompt"] = text
        if salt is not None:
            forwarded["cache_salt"] = salt
        if request_id is None:   # a fresh id the caller has not taken
            request_id = next(i for i in (f"dp-{n}" for n in self._ids) if i not in self._owner)
        request_id = str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        engine = self.route(token_ids, lora_cache_salt(salt, lora_request), digests)
        engine.add_request(request_id, forwarded, params, arrival_time, lora_request, priority, pooling_params)
        self._owner[request_id] = engine
        return request_id

    def add_lora(self, lora_request) -> bool:
        return all([engine.add_lora(lora_request) for engine in self.engines])

    def remove_lora(self, lora_int_id: int) -> bool:
        return any([engine.remove_lora(lora_int_id) for engine in self.engines])

    def list_loras(self) -> set[int]:
        return set().union(*(engine.list_loras() for engine in self.engines))

    def abort_request(self, request_id: str) -> None:
        engine = self._owner.pop(request_id, None)
        if engine is not None:
            engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner) or bool(self._held)

    def has_work(self) -> bool:
        return any(engine.has_work() for engine in self.engines)

    def release(self, request_id: str) -> None:
        """A request's last output was delivered (with deferred outputs step() does not see it)."""
        self._owner.pop(request_id, None)

    def get_num_unfinished_requests(self) -> int:
        return len(self._owner)

    # ---- the loop ------------------------------------------------------------------------
    def step(self, defer_outputs: bool = False) -> list[RequestOutput]:
        """One step of every replica; the outputs of all of them (defer_outputs: see LLMEngine.step).

        A replica whose step fails raises StepFailedError (its requests aborted, as LLMEngine
        does) after the other replicas have stepped; their outputs come with the next call."""
        outputs, self._held = self._held, []
        failures: list[StepFailedError] = []
        for engine in self.engines:
            try:
                outputs += engine.step(defer_outputs)
            except StepFailedError as exc:
                failures.append(exc)
                outputs += exc.outputs
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        if failures:
            failed = [rid for exc in failures for rid in exc.request_ids]
            for rid in failed:
                self._owner.pop(rid, None)
            self._held = outputs
            raise StepFailedError("; ".join(str(exc) for exc in failures), failed) from failures[0]
        return outputs

    # ---- metrics -------------------------------------------------------------------------
    def get_metrics_per_rank(self) -> list[dict[str, float]]:
        return [engine.get_metrics() for engine in self.engines]

    def get_metrics(self) -> dict[str, float]:
        per_rank = self.get_metrics_per_rank()
        summed = {}
        for name in per_rank[0]:
            total = sum(m[name] for m in per_rank)
            summed[name] = total / len(per_rank) if name in _MEAN_METRICS else total
        return summed

    def get_tokenizer(self):
        return self.tokenizer

    is_follower = False   # several hosts run one replica (EngineArgs refuses dp > 1 with num_nodes > 1)

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()
