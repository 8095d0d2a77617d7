"""Engine arguments, with vLLM's names and meanings."""

import dataclasses
import json
import os

from jaxpaged.models.quantization import ALLOWED as QUANTIZATIONS
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.kernels.backends import BACKENDS as ATTENTION_BACKENDS
from jaxpaged.kernels.layout import KV_CACHE_DTYPES


# The default of optimization_level where the argument is not given (a test suite or CI of tiny
# models compiling at 0, say); unset: 2.
OPTIMIZATION_LEVEL_ENV = "JAXPAGED_OPTIMIZATION_LEVEL"


def xla_compiler_options(optimization_level: int) -> dict:
    """vLLM's optimization levels in XLA's terms: 0 and 1 lower the optimization of the code XLA
    generates (LLVM's level: a tiny model's step compiles in about two thirds of the time on
    XLA:CPU; elementwise work runs slower), 2 and 3 are XLA's default (3). Always explicit, so the
    level holds whatever a process's XLA_FLAGS say for its other programs (a test suite compiles its
    own at 0)."""
    return {"xla_backend_optimization_level": optimization_level if optimization_level < 2 else 3}


def json_config(name: str, value, keys) -> dict:
    """A dict-valued engine argument (speculative_config, pooler_config) as a dict: given as one, or as
    a JSON string of one (the CLI's); ValueError naming the argument for anything else or a key not in `keys`
    (None: any key)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be a JSON object, got {value!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    unknown = set(value) - set(keys) if keys is not None else ()
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {sorted(unknown)}; allowed: {list(keys)}")
    return dict(value)


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None                  # hub id, local folder or .gguf; None = the built-in model
    tokenizer: str | None = None              # defaults to the model's own
    revision: str | None = None
    tokenizer_revision: str | None = None     # the tokenizer's hub revision (vLLM's)
    tokenizer_mode: str = "auto"              # "auto" | "slow" (transformers' use_fast=False)
    skip_tokenizer_init: bool = False         # no tokenizer: token-id prompts, outputs without text
    trust_remote_code: bool = False           # a checkpoint's own config / tokenizer code may run (transformers')
    download_dir: str | None = None           # where a hub id's files are downloaded (None: the hub's own cache)
    hf_overrides: object = None               # config fields changed before the model is built: dict or function
    enforce_eager: bool = False               # vLLM's (no CUDA graphs there), accepted: XLA runs compiled programs
    pipeline_parallel_size: int = 1           # vLLM's; only 1 (tensor_parallel_size and num_nodes scale out)
    dtype: str = "auto"                       # auto | float32 | bfloat16 | float16
    quantization: str | None = "auto"         # auto: the checkpoint's own (GGUF blocks kept); None | int8 | fp8 | int4
    load_format: str = "auto"                 # auto: the checkpoint's weights; dummy: random ones, the config's shapes
    kv_cache_dtype: str = "auto"              # auto: the model dtype; fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2
    calculate_kv_scales: bool = False         # fp8 KV scales from the first prompt batch (else 1.0)
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len) without chunked prefill
    max_model_len: int | None = None          # default: the model's, capped by what the KV pool holds
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4.0                   # GiB of pinned host memory for swapped-out blocks
    kv_offloading_size: float | None = None   # GiB of host memory under the prefix cache (None: no host tier)
    kv_offloading_backend: str | None = None  # "native" (the default when kv_offloading_size is set)
    seed: int = 0
    attention_backend: str = "auto"
    scan_layers: bool | None = None           # lax.scan over stacked layers (None: yes); False: unrolled loop
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"             # "auto" (swap or recompute, whichever costs less) | "recompute" | "swap"
    scheduling_policy: str = "fcfs"           # "fcfs" | "priority" (requests' priority: the lower, the sooner)
    runner: str = "auto"                      # "generate" | "pooling" (embeddings, classifiers) | "auto"
    pooler_config: object = None              # runner="pooling": a PoolerConfig, dict or JSON (None: the model's)
    async_scheduling: bool = True             # plan and prepare step t+1 while the device runs step t
    served_model_name: str | None = None
    generation_config: str = "auto"          # auto: the model's generation_config.json; vllm: ignore it; or a folder
    compile_on_startup: bool = True           # compile the step's shape buckets before serving
    optimization_level: int | None = None     # vLLM's -O: 0 compiles fastest, 2 runs fastest (None: 2, or the env's)
    max_logprobs: int = 20                    # most top logprobs a request may ask for (every step returns this many)
    logprobs_mode: str = "raw_logprobs"       # raw_logprobs | raw_logits | processed_logprobs | processed_logits
    disable_log_stats: bool = True
    tensor_parallel_size: int = 1             # devices each model replica is sharded over (Megatron-style)
    data_parallel_size: int = 1               # model replicas, each with its own batch, KV cache and scheduler
    distributed_coordinator: str | None = None  # HOST:PORT of rank 0's jax.distributed coordinator (several hosts)
    num_nodes: int = 1                        # hosts running this engine together (each runs the same command)
    node_rank: int = 0                        # this host's rank; 0 schedules (and serves), the others follow
    speculative_config: dict | str | None = None  # {"method": "ngram", "num_speculative_tokens": 4, ...} (or JSON)
    enable_lora: bool = False                 # multi-LoRA: requests may name a PEFT adapter (lora_request=)
    max_loras: int = 1                        # adapters in one step (each a slot of stacked weights on the device)
    max_lora_rank: int = 16                   # the largest adapter rank (smaller ones are zero-padded)
    max_cpu_loras: int | None = None          # adapters kept on the host (default: max_loras)
    enable_sleep_mode: bool = False           # vLLM's flag, accepted: sleep()/wake_up() work on every engine
    profiler_config: dict | str | None = None  # {"profiler": "jax", "profiler_dir": DIR}: start_profile() works
    reasoning_parser: str | None = None       # jaxpaged.reasoning's: structured outputs apply after </think>
    enable_prompt_embeds: bool = False        # prompts may be rows of input embeddings ({"prompt_embeds": array})
    limit_mm_per_prompt: dict | str | None = None   # {"image": N}: a prompt's most images (None: no bound)
    allowed_local_media_path: str | None = None   # the folder file:// image URLs may be read from (None: refused)
    mm_processor_kwargs: dict | str | None = None   # the image processor's overrides (Qwen2-VL's max_pixels, ...)
    enable_mm_embeds: bool = False   # multi_modal_data's images may be their rows ({"image_embeds": array})
    logits_processors: list | None = None   # custom ones: jaxpaged.LogitsProcessor subclasses or 'module:Class'

    def batched_tokens(self, max_model_len: int) -> int:
        """The per-step token budget: given, or 2048 (at least max_model_len without chunked prefill)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)

    def __post_init__(self):
        def require(name, ok, allowed):
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if self.optimization_level is None:
            default = os.environ.get(OPTIMIZATION_LEVEL_ENV, "2")
            if default not in ("0", "1", "2", "3"):
                raise ValueError(f"{OPTIMIZATION_LEVEL_ENV} must be 0, 1, 2 or 3, got {default!r}")
            self.optimization_level = int(default)
        require("optimization_level", type(self.optimization_level) is int and 0 <= self.optimization_level <= 3,
                "0, 1, 2 or 3 (None: the default, 2)")

        require("block_size", isinstance(self.block_size, int) and self.block_size in (8, 16, 32, 64, 128),
                "one of 8, 16, 32, 64, 128")
        require("max_num_seqs", isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, ">= 1")
        require("max_num_batched_tokens", self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                "None or >= 1")
        require("max_model_len", self.max_model_len is None or self.max_model_len >= 2, "None or >= 2")
        require("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]")
        require("num_gpu_blocks_override", self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
                "None or >= 2")
        require("kv_cache_memory_bytes", self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                "None or > 0")
        require("swap_space", self.swap_space >= 0, ">= 0 (GiB)")
        from jaxpaged.core.host_cache import KV_OFFLOADING_BACKENDS
        require("kv_offloading_size", self.kv_offloading_size is None or (
            isinstance(self.kv_offloading_size, (int, float)) and not isinstance(self.kv_offloading_size, bool)
            and self.kv_offloading_size > 0), "None or > 0 (GiB of host memory)")
        require("kv_offloading_backend", self.kv_offloading_backend in (None, *KV_OFFLOADING_BACKENDS),
                f"None or one of {', '.join(repr(b) for b in KV_OFFLOADING_BACKENDS)}")
        require("kv_offloading_backend", self.kv_offloading_backend is None or self.kv_offloading_size is not None,
                "set together with kv_offloading_size (GiB of host memory for the tier)")
        require("kv_offloading_size", self.kv_offloading_size is None or self.enable_prefix_caching,
                "None when enable_prefix_caching is off (the host tier is the prefix cache's)")
        require("attention_backend", self.attention_backend in ATTENTION_BACKENDS,
                f"one of {', '.join(ATTENTION_BACKENDS)}")
        from jaxpaged.models.loader import LOAD_FORMATS
        require("load_format", self.load_format in LOAD_FORMATS, f"one of {', '.join(map(repr, LOAD_FORMATS))}")
        require("quantization", self.quantization in QUANTIZATIONS,
                f"one of {', '.join(repr(q) for q in QUANTIZATIONS)}")
        require("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"one of {', '.join(repr(d) for d in KV_CACHE_DTYPES)}")
        require("calculate_kv_scales", isinstance(self.calculate_kv_scales, bool), "True or False")
        require("scan_layers", self.scan_layers is None or isinstance(self.scan_layers, bool), "None, True or False")
        from jaxpaged.core.preemption import PREEMPTION_MODES
        require("preemption_mode", self.preemption_mode in PREEMPTION_MODES,
                f"one of {', '.join(repr(m) for m in PREEMPTION_MODES)}")
        from jaxpaged.pooling_params import RUNNERS
        require("runner", self.runner in RUNNERS, f"one of {', '.join(repr(r) for r in RUNNERS)}")
        require("pooler_config", self.pooler_config is None or self.runner != "generate",
                'None with runner="generate"')
        from jaxpaged.core.request_queue import SCHEDULING_POLICIES
        require("scheduling_policy", self.scheduling_policy in SCHEDULING_POLICIES,
                f"one of {', '.join(repr(p) for p in SCHEDULING_POLICIES)}")
        require("seed", isinstance(self.seed, int), "an int")
        require("tensor_parallel_size", isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                "an int >= 1")
        require("data_parallel_size", isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
                "an int >= 1")
        require("num_nodes", isinstance(self.num_nodes, int) and self.num_nodes >= 1, "an int >= 1")
        require("node_rank", isinstance(self.node_rank, int) and 0 <= self.node_rank < self.num_nodes,
                f"an int in [0, num_nodes={self.num_nodes})")
        require("distributed_coordinator", self.num_nodes == 1 or (isinstance(self.distributed_coordinator, str)
                                                                     and ":" in self.distributed_coordinator),
                "HOST:PORT of rank 0 when num_nodes > 1")
        require("data_parallel_size", self.num_nodes == 1 or self.data_parallel_size == 1,
                "1 when num_nodes > 1 (several hosts run one tensor-parallel replica)")
        require("max_logprobs", isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= MAX_LOGPROBS,
                f"an int in [0, {MAX_LOGPROBS}]")
        from jaxpaged.runner.sampler import LOGPROBS_MODES
        require("logprobs_mode", self.logprobs_mode in LOGPROBS_MODES, f"one of {', '.join(map(repr, LOGPROBS_MODES))}")
        from jaxpaged.engine.spec_decode import SpeculativeConfig
        spec = SpeculativeConfig.parse(self.speculative_config)   # ValueErrors name the key and what it allows
        require("speculative_config", spec is None or spec.method != "draft_model" or self.num_nodes == 1,
                "prompt lookup (method 'ngram') when num_nodes > 1 (a draft model runs on one host only)")
        require("speculative_config", spec is None or self.runner != "pooling", 'None with runner="pooling"')
        require("enable_lora", isinstance(self.enable_lora, bool), "True or False")
        require("enable_sleep_mode", isinstance(self.enable_sleep_mode, bool), "True or False")
        require("max_loras", isinstance(self.max_loras, int) and self.max_loras >= 1, "an int >= 1")
        require("max_lora_rank", isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512,
                "an int in [1, 512]")
        require("max_cpu_loras", self.max_cpu_loras is None or (isinstance(self.max_cpu_loras, int)
                                                                and self.max_cpu_loras >= self.max_loras),
                f"None or an int >= max_loras ({self.max_loras})")
        require("enable_lora", not self.enable_lora or self.num_nodes == 1, "False when num_nodes > 1")
        require("enable_lora", not self.enable_lora or spec is None or spec.method == "ngram",
                "False with a draft model (speculative_config method 'draft_model'); prompt lookup works")
        require("enable_prompt_embeds", isinstance(self.enable_prompt_embeds, bool), "True or False")
        require("enable_mm_embeds", isinstance(self.enable_mm_embeds, bool), "True or False")
        require("allowed_local_media_path", self.allowed_local_media_path is None or (
            isinstance(self.allowed_local_media_path, str) and os.path.isdir(self.allowed_local_media_path)),
            "None or an existing folder")
        if self.mm_processor_kwargs is not None:
            self.mm_processor_kwargs = json_config("mm_processor_kwargs", self.mm_processor_kwargs, None)
        if self.limit_mm_per_prompt is not None:
            self.limit_mm_per_prompt = json_config("limit_mm_per_prompt", self.limit_mm_per_prompt, ("image",))
            count = self.limit_mm_per_prompt.get("image")
            require("limit_mm_per_prompt", count is None or (isinstance(count, int) and not isinstance(count, bool)
                                                             and count >= 0), "{'image': an int >= 0}")
        require("tokenizer_mode", self.tokenizer_mode in ("auto", "slow"), "'auto' or 'slow'")
        require("download_dir", self.download_dir is None or (isinstance(self.download_dir, str)
                                                             and self.download_dir != ""), "None or a folder path")
        for flag in ("skip_tokenizer_init", "trust_remote_code", "enforce_eager"):
            require(flag, isinstance(getattr(self, flag), bool), "True or False")
        if isinstance(self.hf_overrides, str):   # the CLI's JSON
            self.hf_overrides = json_config("hf_overrides", self.hf_overrides, None)
        require("hf_overrides", self.hf_overrides is None or isinstance(self.hf_overrides, dict)
                or callable(self.hf_overrides), "None, a dict of config fields or a function of the config")
        require("pipeline_parallel_size", self.pipeline_parallel_size == 1,
                "1 (pipeline parallelism is not supported: scale out with tensor_parallel_size, data_parallel_size "
                "and num_nodes)")
        for name, ok in (("speculative_config", spec is None), ("num_nodes", self.num_nodes == 1),
                         ("runner", self.runner != "pooling")):
            require("enable_prompt_embeds", not self.enable_prompt_embeds or ok,
                    f"False with {name}={getattr(self, name)!r} (prompt embeddings run on one host, generating, "
                    "without speculative decoding)")
        if self.logits_processors is not None:
            from jaxpaged.logits_processor import load_logits_processors
            load_logits_processors(self.logits_processors)   # ValueErrors name the entry and what it must be
            for name, ok in (("speculative_config", spec is None), ("num_nodes", self.num_nodes == 1),
                             ("runner", self.runner != "pooling")):
                require("logits_processors", not self.logits_processors or ok,
                        f"None with {name}={getattr(self, name)!r} (custom logits processors run in a generating "
                        "engine on one host, without speculative decoding)")
        from jaxpaged.reasoning import REASONING_PARSERS
        require("reasoning_parser", self.reasoning_parser in (None, *REASONING_PARSERS),
                f"None or one of {', '.join(map(repr, REASONING_PARSERS))}")
        from jaxpaged.engine.profiler import ProfilerConfig
        ProfilerConfig.parse(self.profiler_config)   # ValueErrors name the key and what it allows
        require("generation_config", isinstance(self.generation_config, str) and self.generation_config != "",
                "'auto', 'vllm' or a folder holding generation_config.json")
