"""The offline API, shaped like vLLM's `LLM`."""

import dataclasses
import time
from typing import Any, Sequence

from jaxpaged.chat_utils import render_chat_images
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.dp_engine import make_engine
from jaxpaged.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from jaxpaged.pooling_params import POOLING_TASKS, PoolingParams, cosine_similarity, cross_encoder_ids, score_pairs
from jaxpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict


def _as_prompt_list(prompts) -> list:
    """One prompt (a str, a token-id list or a dict) or a sequence of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _per_prompt(lora_request, num_prompts: int) -> list:
    """generate's lora_request: one for every prompt, or a list of one (or None) per prompt."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts; pass one "
                             "LoRARequest (or None) or one per prompt")
        return list(lora_request)
    return [lora_request] * num_prompts


def _truncated(pooling_params, truncate_prompt_tokens: int | None):
    """pooling_params (None, one or a list) with truncate_prompt_tokens set, when it is given."""
    if truncate_prompt_tokens is None:
        return pooling_params
    items = [pooling_params or PoolingParams()] if not isinstance(pooling_params, (list, tuple)) else pooling_params
    items = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in items]
    return items if isinstance(pooling_params, (list, tuple)) else items[0]


def _final_only(params: SamplingParams | None):
    """A copy of `params` asking the engine for the finished output only: `generate` returns
    nothing else, and per-step outputs would copy every token list every step. The caller's
    object is unchanged."""
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        return params   # add_request refuses it with a ValueError naming sampling_params
    params = params.clone()   # not dataclasses.replace: that would mark every field as set by the caller
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


class LLM:
    """Generate from a batch of prompts with continuous batching over a paged KV cache.

    `model` is a Hugging Face id, a local folder (config.json + safetensors) or a .gguf
    file; None runs the built-in SmolLM2-135M-Instruct.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_gpu_blocks_override: int | None = None, seed: int = 0, attention_backend: str = "auto",
                 **kwargs: Any):
        use_tqdm = kwargs.pop("use_tqdm", True)
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, block_size=block_size,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                          num_gpu_blocks_override=num_gpu_blocks_override, seed=seed,
                          attention_backend=attention_backend, **kwargs)
        self.llm_engine = make_engine(args, use_tqdm=use_tqdm)   # a DataParallelEngine when data_parallel_size > 1
        self._counter = 0
        # several hosts: ranks other than 0 run rank 0's steps here, until rank 0's engine shuts down
        self.is_follower = self.llm_engine.is_follower
        if self.is_follower:
            self.llm_engine.follow()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    # ---- research loops: weights in place, pause, sleep, adapters ------------------------------
    def _on_replicas(self, method: str, *args) -> list:
        """engine.method(*args) on every data-parallel replica; their results."""
        return [getattr(engine, method)(*args) for engine in self.llm_engine.replicas()]

    def start_profile(self) -> None:
        """Start a JAX profiler trace (vLLM's; the engine made with profiler_config={"profiler": "jax",
        "profiler_dir": DIR}): what runs until stop_profile() is traced (engine/profiler.py)."""
        self.llm_engine.profiler.start()

    def stop_profile(self) -> None:
        """Stop the trace and write it under profiler_dir (TensorBoard / XProf, and Perfetto)."""
        self.llm_engine.profiler.stop()

    def update_weights(self, weights) -> None:
        """Write weights in place: a mapping or an iterable of (name, array) with Hugging Face names
        (`model.layers.0.self_attn.q_proj.weight`, ...), arrays from JAX, NumPy or anything with
        `__array__`; partial updates are fine. Shapes and dtypes are checked (ValueError naming the
        parameter, nothing written); the prefix cache is reset; nothing recompiles."""
        if not isinstance(weights, dict):
            weights = list(weights)   # an iterator is read once, for every replica
        self._on_replicas("update_weights", weights)

    def reset_prefix_cache(self) -> None:
        self._on_replicas("reset_prefix_cache")

    def apply_model(self, func) -> list:
        """func(model) on each data-parallel replica's model (a Flax NNX module over its weights, on its
        devices), as vLLM runs it in each worker; their results. func may write weights in place, with their
        shapes and dtypes (LLMEngine.apply_model); the prefix cache then starts afresh."""
        return self._on_replicas("apply_model", func)

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: call `method` (a ModelRunner method's name, or a function taking the runner first) on each
        replica's worker (with several hosts, this process's); their results. `timeout` is accepted and unused:
        the calls run here, in order."""
        return self._on_replicas("collective_rpc", method, args, kwargs)

    def pause_generation(self) -> None:
        """Requests in flight stop where they are (until resume_generation) and continue on whatever
        weights update_weights writes meanwhile."""
        self._on_replicas("pause_generation")

    def resume_generation(self) -> None:
        self._on_replicas("resume_generation")

    def sleep(self, level: int = 1) -> None:
        """Give device memory back: level 1 drops the KV cache and moves the weights to host memory;
        level 2 drops both (update_weights after wake_up)."""
        self._on_replicas("sleep", level)

    def wake_up(self) -> None:
        self._on_replicas("wake_up")

    def add_lora(self, lora_request) -> bool:
        """Register a LoRA adapter ahead of its requests (needs enable_lora; its folder is read now)."""
        return all(self._on_replicas("add_lora", lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests running with it finish with it); False if unknown."""
        return any(self._on_replicas("remove_lora", lora_int_id))

    def list_loras(self) -> set[int]:
        return set().union(*self._on_replicas("list_loras"))

    def is_sleeping(self) -> bool:
        return any(engine.is_sleeping() for engine in self.llm_engine.replicas())

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's name); changes nothing."""
        return self.llm_engine.generation_defaults.apply(SamplingParams())

    def get_metrics(self) -> dict[str, float]:
        return self.llm_engine.get_metrics()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A bad prompt or parameter raises ValueError before anything is queued. Each prompt's
        output is its final (cumulative) one, whatever `output_kind` the params ask for.
        `lora_request`: a LoRARequest for every prompt, or a list of one (or None) per prompt
        (the engine needs enable_lora). `priority`: one int per prompt, the lower the sooner (the
        engine needs scheduling_policy="priority").
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [_final_only(sampling_params)] * len(prompts)
        else:
            params_list = [_final_only(params) for params in sampling_params]
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts; "
                                 "pass one SamplingParams or one per prompt")
        if priority is not None and (isinstance(priority, (str, bytes)) or not hasattr(priority, "__len__")
                                     or len(priority) != len(prompts)):
            raise ValueError(f"priority must be a list of one int per prompt ({len(prompts)}), got {priority!r}")
        return self._run(prompts, params_list, use_tqdm, _per_prompt(lora_request, len(prompts)), priority)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *, use_tqdm: bool = True,
               lora_request=None, pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Pool every prompt (an engine made with runner="pooling"); outputs in input order, each's
        `outputs.data` an f32 numpy array. `pooling_params`: one PoolingParams or one per prompt;
        `pooling_task`: "embed", "classify" or "score" for all of them (None: each PoolingParams' task,
        else the model's own: "embed" for an embedding model, "classify" for a classifier)."""
        if pooling_task is not None and pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be None or one of {', '.join(POOLING_TASKS)}, got {pooling_task!r}")
        if getattr(self.llm_engine, "pooling", None) is None:
            raise ValueError("LLM.embed(), LLM.classify() and LLM.encode() need a pooling model: make the LLM with "
                             "runner='pooling' (vLLM's --runner pooling)")
        prompts = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            pooling_list = list(pooling_params)
            if len(pooling_list) != len(prompts):
                raise ValueError(f"pooling_params has {len(pooling_list)} entries for {len(prompts)} prompts; "
                                 "pass one PoolingParams or one per prompt")
        if pooling_task is not None:
            pooling_list = [dataclasses.replace(p, task=pooling_task) for p in pooling_list]
        return self._run(prompts, [None] * len(prompts), use_tqdm, _per_prompt(lora_request, len(prompts)),
                         pooling=pooling_list)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's LLM.embed): `outputs.embedding`, a list of floats."""
        pooling_params = _truncated(pooling_params, truncate_prompt_tokens)
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(out) for out in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 lora_request=None) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (vLLM's LLM.classify, a *ForSequenceClassification model: a
        classifier, a reward model): `outputs.probs`, a list of floats; PoolingParams(use_activation=False)
        gives the raw logits (a reward model's reward)."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify")
        return [ClassificationRequestOutput.from_base(out) for out in outs]

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request=None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score, one text against several (1 to N) or pair by pair (N to N); outputs in data_2's
        order. An embedding model: the cosine similarity of each pair's embeddings. A cross-encoder (a
        classifier with one label): the model's score of the pair read as one sequence (the tokenizer's pair
        encoding; `truncate_prompt_tokens` keeps its last tokens)."""
        first, second = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = score_pairs(len(first), len(second))
        pooling_params = _truncated(pooling_params, truncate_prompt_tokens)
        if getattr(getattr(self.llm_engine, "pooling", None), "num_labels", 0):
            tokenizer = self.get_tokenizer()
            joined = [{"prompt_token_ids": cross_encoder_ids(tokenizer, first[i], second[j])} for i, j in pairs]
            outs = self.encode(joined, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                               pooling_task="score")
            return [ScoringRequestOutput(out.request_id, ScoringOutput(float(out.outputs.data[0])),
                                         out.prompt_token_ids) for out in outs]
        outs = self.embed(first + second, use_tqdm=use_tqdm, pooling_params=pooling_params, lora_request=lora_request)
        firsts, seconds = outs[:len(first)], outs[len(first):]
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}",
                                     ScoringOutput(cosine_similarity(a.outputs.embedding, b.outputs.embedding)),
                                     a.prompt_token_ids + b.prompt_token_ids)
                for a, b in ((firsts[i], seconds[j]) for i, j in pairs)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict] | None = None, lora_request=None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate.

        `tools` (OpenAI function tools) go to the template, as in vLLM, and `chat_template_kwargs` as more
        of its variables (Qwen3's {"enable_thinking": False}); the output is the model's text (read tool
        calls from it with `jaxpaged.tool_parsers.get_tool_parser(name)()`, or force them with
        `structured_outputs`; split a thinking model's reasoning with `jaxpaged.reasoning.ReasoningParser`).
        `continue_final_message` (with add_generation_prompt=False): the last message, an assistant's answer
        begun, is continued instead of a new turn opened. `mm_processor_kwargs`: the image processor's arguments
        for these conversations' images, over the engine's (Qwen2-VL's {"max_pixels": ...}).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        processor = self.llm_engine.replicas()[0].input_processor
        prompts = []
        for conversation in conversations:
            text, images = render_chat_images(tokenizer, conversation, processor.images or processor.no_images,
                                              tools, chat_template, add_generation_prompt, chat_template_kwargs,
                                              continue_final_message)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
            if images:   # (a message's image parts, as vLLM's chat: `image_url`, `image_pil`)
                prompts[-1]["multi_modal_data"] = {"image": images}
                if mm_processor_kwargs is not None:
                    prompts[-1]["mm_processor_kwargs"] = mm_processor_kwargs
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request=None):
        """Beam search per prompt; returns one BeamSearchOutput per prompt, `sequences` best first.

        Each round runs every beam as a one-token request; the prefix cache shares their common blocks.
        `lora_request`: a LoRARequest for every prompt, or a list of one (or None) per prompt.
        """
        from jaxpaged.engine.beam_search import run_beam_search
        self._check_leader()
        if isinstance(params, SamplingParams):   # vLLM's beam search takes no constraint either
            raise ValueError("beam_search takes a BeamSearchParams (beam_width, max_tokens, ignore_eos, temperature, "
                             "length_penalty); structured_outputs and the other SamplingParams fields are not "
                             "supported by beam search" if params.structured_outputs is None else
                             "structured_outputs is not supported by beam search: sample with LLM.generate "
                             "(n > 1 for several candidates) to constrain the output")
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if self.llm_engine.args.logprobs_mode.endswith("_logits"):   # beams are ranked by summed logprobs
            raise ValueError(f"beam search ranks beams by logprobs; this engine's logprobs_mode is "
                             f"{self.llm_engine.args.logprobs_mode!r} (allowed: 'raw_logprobs', 'processed_logprobs')")
        if any(e.speculator is not None for e in self.llm_engine.replicas()):
            raise ValueError("beam search is not supported with speculative_config: make an LLM without "
                             "speculative_config for beam search")
        prompts = _as_prompt_list(prompts)
        if any(isinstance(p, dict) and p.get("cache_salt") is not None for p in prompts):
            raise ValueError("cache_salt is not supported by beam_search yet; drop it from the prompt dicts")
        engine = self.llm_engine.replicas()[0]   # with data parallelism, beam search runs on the first replica
        token_lists = [engine.input_processor.tokenize(p)[1] for p in prompts]
        return run_beam_search(engine, token_lists, params, _per_prompt(lora_request, len(prompts)))

    def shutdown(self) -> None:
        """Several hosts: release the other ranks (their LLM(...) returns). Also runs at exit."""
        self.llm_engine.shutdown()

    def _check_leader(self) -> None:
        if self.is_follower:
            raise RuntimeError("this host (node_rank > 0) ran rank 0's steps until rank 0 shut down; "
                               "requests go to rank 0")

    def _run(self, prompts: list, params_list: list[SamplingParams], use_tqdm: bool,
             loras: list | None = None, priorities: Sequence[int] | None = None,
             pooling: list | None = None) -> list:
        self._check_leader()
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params, lora, priority, pooling_params in zip(
                    prompts, params_list, loras or [None] * len(prompts), priorities or [0] * len(prompts),
                    pooling or [None] * len(prompts)):
                request_id = f"gen-{self._counter}"
                self._counter += 1
                ids.append(engine.add_request(request_id, prompt, params, lora_request=lora, priority=priority,
                                              pooling_params=pooling_params))
        except Exception:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        from tqdm.auto import tqdm
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        start = time.perf_counter()
        num_tokens = 0
        try:
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="req") as bar:
                while len(finished) < len(ids):
                    for out in engine.step():
                        if out.finished and out.request_id in wanted:
                            finished[out.request_id] = out
                            if isinstance(out, RequestOutput):   # (a pooled prompt generates none)
                                num_tokens += sum(len(c.token_ids) for c in out.outputs)
                            bar.update(1)
                            elapsed = max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"output {num_tokens / elapsed:.1f} tok/s")
        except BaseException:   # an error or Ctrl-C: drop this call's requests so the engine stays usable
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]
