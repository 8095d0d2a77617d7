"""Engine start-up: load the model and tokenizer, size the KV pool, compile the step buckets."""

import json
import logging
import os

import jax

from jaxpaged.core.kv_cache_manager import cdiv
from jaxpaged.engine import memory
from jaxpaged.engine.arg_utils import EngineArgs, xla_compiler_options
from jaxpaged.engine.multimodal import takes_images
from jaxpaged.models.hub_options import HubOptions
from jaxpaged.logits_processor import LogitsProcessorConfig, LogitsProcessors, load_logits_processors
from jaxpaged.models.loader import LoadedModel, load_model
from jaxpaged.parallel import ShardPlan
from jaxpaged.runner import multihost
from jaxpaged.runner.model_runner import ModelRunner
from jaxpaged.kernels.layout import kv_storage_dtype

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30   # 1 GiB by default on CPU


def enable_compilation_cache() -> None:
    """Persist compiled executables across processes (start-up compiles become disk reads)."""
    path = os.environ.get("JAXPAGED_COMPILATION_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged", "jax"))
    if path and path != "0":
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ.get("JAXPAGED_COMPILATION_CACHE_MIN_SECS", 0.5)))


def load_tokenizer(args: EngineArgs, loaded: LoadedModel):
    """The model's tokenizer (or `tokenizer`'s), as vLLM's tokenizer_mode ("slow": transformers' Python
    tokenizer), tokenizer_revision and trust_remote_code ask; None with skip_tokenizer_init (token-id prompts,
    outputs without text)."""
    from transformers import AutoTokenizer
    if args.skip_tokenizer_init:
        return None
    options = dict(trust_remote_code=args.trust_remote_code, revision=args.tokenizer_revision,
                   cache_dir=args.download_dir,
                   **({"use_fast": False} if args.tokenizer_mode == "slow" else {}))
    if args.tokenizer is not None:
        return AutoTokenizer.from_pretrained(args.tokenizer, **options)
    if loaded.source.endswith(".gguf"):
        from jaxpaged.models.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(loaded.source)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(loaded.source, n)) for n in names):
        logger.warning("no tokenizer in %s: only token-id prompts will work", loaded.source)
        return None
    tokenizer = AutoTokenizer.from_pretrained(loaded.source, **options)
    if getattr(tokenizer, "chat_template", None) is None:   # a vision-language model's processor may hold it
        tokenizer.chat_template = processor_chat_template(loaded.source)
    return tokenizer


def processor_chat_template(folder: str) -> str | None:
    """The chat template a model folder gives beside its tokenizer: chat_template.jinja, or a processor's
    chat_template.json ({"chat_template": ...}, as vision-language checkpoints ship it); None if neither."""
    jinja, processor = os.path.join(folder, "chat_template.jinja"), os.path.join(folder, "chat_template.json")
    if os.path.exists(jinja):
        with open(jinja) as f:
            return f.read()
    if os.path.exists(processor):
        with open(processor) as f:
            return json.load(f).get("chat_template")
    return None


def engine_devices(args: EngineArgs, data_rank: int = 0) -> list:
    """The devices of data-parallel rank `data_rank`: tensor_parallel_size of them, in order."""
    devices = jax.devices()
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    if tp * dp > len(devices):
        raise ValueError(f"tensor_parallel_size x data_parallel_size ({tp} x {dp} = {tp * dp}) must be at most the "
                         f"number of devices, {len(devices)} ({devices[0].platform})")
    if not 0 <= data_rank < dp:
        raise ValueError(f"data_rank must be in [0, {dp}), got {data_rank}")
    if jax.process_count() > 1 and tp != len(devices):   # every host must hold part of the one mesh
        raise ValueError(f"tensor_parallel_size must be the number of devices of all {jax.process_count()} hosts "
                         f"together ({len(devices)}) when num_nodes > 1, got {tp}")
    return devices[data_rank * tp:(data_rank + 1) * tp]


def load_model_and_tokenizer(args: EngineArgs, data_rank: int = 0):
    if args.num_gpu_blocks_override is None and args.kv_cache_memory_bytes is None:
        preset = memory.preset_mem_fraction(args.gpu_memory_utilization)   # must precede JAX's first GPU call
        if preset:
            logger.info(preset)
    multihost.initialize(args.distributed_coordinator, args.num_nodes, args.node_rank)   # likewise
    model = args.model
    name = args.served_model_name
    if model is None:
        from jaxpaged.models.builtin import BUILTIN_MODEL_NAME, builtin_model_path
        model = builtin_model_path()
        name = name or BUILTIN_MODEL_NAME
    from jaxpaged.kernels.backends import resolve_backend
    backend = resolve_backend(args.attention_backend)   # validates; auto is refined below on GPU
    # one replica on one device keeps JAX's default placement; replicas pin their own devices
    plan = ShardPlan.for_devices(engine_devices(args, data_rank), pin=args.data_parallel_size > 1)
    loaded = load_model(model, args.dtype, args.revision, attention_backend=backend, scan_layers=args.scan_layers,
                        shard_plan=plan, quantization=args.quantization, load_format=args.load_format,
                        hub=HubOptions.of(args))
    if args.attention_backend == "auto" and jax.devices()[0].platform == "gpu":
        cfg = loaded.config
        loaded.model.attention_backend = resolve_backend(
            "auto", head_shape=(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            dtype=loaded.model.dtype)
    if args.enable_lora:
        from jaxpaged.models.config import model_config_from_hf
        from jaxpaged.lora.slots import attach_lora
        kv_heads = model_config_from_hf(loaded.hf_config).num_kv_heads
        if loaded.config.is_moe:
            raise ValueError(f"enable_lora does not yet support {loaded.config.architecture} (a mixture of experts); "
                             "LoRA runs on the dense families")
        if plan.size > kv_heads:   # K/V heads repeated over the devices: adapters' K/V columns are not (yet)
            raise ValueError(f"enable_lora needs tensor_parallel_size ({plan.size}) at most the model's "
                             f"{kv_heads} KV heads")
        attach_lora(loaded.model, args.max_loras, args.max_lora_rank)
    tokenizer = load_tokenizer(args, loaded)
    return loaded, tokenizer, name or args.model


def _num_blocks(args: EngineArgs, loaded: LoadedModel, max_model_len: int, per_block: int, tokenizer=None) -> int:
    """Blocks of the KV pool; every budget is per device (vLLM's kv_cache_memory_bytes is per GPU),
    and with tensor parallelism each device holds its KV heads of every block."""
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    plan = loaded.model.shard_plan
    per_block //= plan.size
    if args.kv_cache_memory_bytes is not None:
        return max(2, args.kv_cache_memory_bytes // per_block)
    device = plan.local_device   # several hosts: each sizes on its own device (rank 0's count is used)
    if not memory.has_device_memory(device):
        wanted = args.max_num_seqs * cdiv(max_model_len, args.block_size) + 1
        return max(2, min(wanted, CPU_KV_CACHE_BYTES // per_block))
    allocator = memory.AllocatorConfig.from_env()
    report = memory.read_memory_report(device, allocator)   # before the probe runner adds its arrays
    probe = _new_runner(args, loaded, 2, max_model_len, tokenizer=tokenizer)   # the step's memory: not the pool's
    # the largest step, and a vision tower's largest compiled program (run between steps, or beside one in flight)
    activation = memory.step_reserve_bytes(probe) + (loaded.vision.reserve_bytes if loaded.vision else 0)
    del probe
    sizing = memory.size_kv_cache(report, allocator, args.gpu_memory_utilization, per_block, activation,
                                  args.batched_tokens(max_model_len))
    if sizing.warning:
        logger.warning(sizing.warning)
    logger.info("KV cache memory: %.2f GiB of %.2f GiB (weights and other arrays %.2f GiB, largest step %.2f GiB)",
                sizing.kv_cache_bytes / memory.GiB, report.total_bytes / memory.GiB,
                report.bytes_in_use / memory.GiB, activation / memory.GiB)
    return sizing.num_blocks


def kv_dtype(args: EngineArgs, loaded: LoadedModel):
    """The KV pool's element type: the model dtype, or fp8 (kv_cache_dtype)."""
    return kv_storage_dtype(args.kv_cache_dtype, loaded.model.dtype)


def _new_runner(args: EngineArgs, loaded: LoadedModel, num_blocks: int, max_model_len: int,
                num_host_blocks: int = 0, host_cache_slots: int = 0, tokenizer=None) -> ModelRunner:
    processors = None
    # installed plugins too; refused (EngineArgs) or, plugins, left out where they cannot run (as vLLM's are)
    runs_processors = args.runner != "pooling" and args.speculative_config is None and args.num_nodes == 1
    classes = load_logits_processors(args.logits_processors) if runs_processors else ()
    if classes:
        processors = LogitsProcessors(classes, LogitsProcessorConfig(loaded.config.vocab_size, args.max_num_seqs + 1,
                                                                     max_model_len, tokenizer))
    return ModelRunner(loaded.model, num_blocks, args.block_size, max_model_len, args.max_num_seqs,
                       args.batched_tokens(max_model_len), kv_dtype=kv_dtype(args, loaded),
                       num_host_blocks=num_host_blocks, host_cache_slots=host_cache_slots,
                       max_logprobs=args.max_logprobs,
                       calculate_kv_scales=args.calculate_kv_scales,
                       num_speculative_tokens=_num_speculative_tokens(args),
                       compiler_options=xla_compiler_options(args.optimization_level),
                       pooling=_pooling_type(args, loaded),
                       # rows in place of tokens: prompt embeddings, and a vision-language model's images
                       prompt_embeds=args.enable_prompt_embeds or takes_images(args, loaded),
                       logprobs_mode=args.logprobs_mode, logits_processors=processors)


def _pooling_type(args: EngineArgs, loaded: LoadedModel) -> str | None:
    """A pooling engine's pooling_type (its pooler_config, or the checkpoint's own); None for a generating one."""
    if args.runner != "pooling":
        return None
    from jaxpaged.pooling_params import PoolerConfig
    return PoolerConfig.of(args.pooler_config, loaded.source if os.path.isdir(loaded.source) else None).pooling_type


def _num_speculative_tokens(args: EngineArgs) -> int:
    from jaxpaged.engine.spec_decode import SpeculativeConfig
    spec = SpeculativeConfig.parse(args.speculative_config)
    return 0 if spec is None else spec.num_speculative_tokens


def build_runner(args: EngineArgs, loaded: LoadedModel, use_tqdm: bool = True, draft: LoadedModel | None = None,
                 tokenizer=None):
    """Returns (runner, max_model_len, num_blocks). `draft`: a speculative draft model, whose KV pool
    has as many blocks as the target's (the memory budget is shared between the two pools). `tokenizer`: the
    engine's (custom logits processors get it)."""
    cfg = loaded.config
    model_max = cfg.max_model_len
    if args.max_model_len is not None and args.max_model_len > model_max:
        scaled = "" if model_max == cfg.max_position_embeddings else f" scaled by its {cfg.rope_type} rope"
        raise ValueError(f"max_model_len ({args.max_model_len}) is larger than the model's "
                         f"max_position_embeddings{scaled} ({model_max})")
    max_model_len = args.max_model_len or model_max
    per_block = ModelRunner.bytes_per_block(cfg, args.block_size, kv_dtype(args, loaded))
    if draft is not None:
        per_block += ModelRunner.bytes_per_block(draft.config, args.block_size, draft.model.dtype)
    enable_compilation_cache()   # the KV sizing compiles the step's largest buckets
    num_blocks = multihost.broadcast_value(_num_blocks(args, loaded, max_model_len, per_block, tokenizer))   # rank 0's
    capacity = (num_blocks - 1) * args.block_size
    if max_model_len > capacity:
        if args.max_model_len is not None:
            raise ValueError(f"max_model_len ({max_model_len}) is larger than the KV cache can hold "
                             f"({capacity} tokens in {num_blocks - 1} blocks of {args.block_size}); lower "
                             "max_model_len or give the cache more memory")
        max_model_len = capacity
    num_host_blocks = 0
    if args.preemption_mode in ("swap", "auto"):
        num_host_blocks = int(args.swap_space * (1 << 30)) // per_block
        if num_host_blocks < 1 and args.preemption_mode == "swap":
            logger.warning("swap_space %.3f GiB holds no block: preemption falls back to recompute",
                           args.swap_space)
    host_cache_slots = 0
    if args.kv_offloading_size is not None:   # the tier's GiB are shared by the data-parallel replicas
        host_cache_slots = int(args.kv_offloading_size * (1 << 30) / args.data_parallel_size) // per_block
        if host_cache_slots < 4:
            raise ValueError(f"kv_offloading_size ({args.kv_offloading_size} GiB) holds {host_cache_slots} blocks of "
                             f"{per_block} bytes; give it at least {4 * per_block * args.data_parallel_size / (1 << 30):.3g} "
                             "GiB (4 blocks per replica)")
    runner = _new_runner(args, loaded, num_blocks, max_model_len, num_host_blocks, host_cache_slots, tokenizer)
    logger.info("KV cache: %d blocks of %d tokens (%d tokens), max_model_len %d", num_blocks - 1,
                args.block_size, capacity, max_model_len)
    if args.compile_on_startup:
        import time

        from tqdm.auto import tqdm
        shapes = runner.warmup_shapes()
        start = time.perf_counter()
        with tqdm(total=len(shapes), desc=f"Compiling {len(shapes)} step variants", disable=not use_tqdm) as bar:
            runner.warmup(shapes, bar)
        logger.info("compiled %d step variants in %.1f s (tokens x sequences buckets; nothing compiles "
                    "after start-up)", len(shapes), time.perf_counter() - start)
        device = runner.plan.local_device
        stats = memory.memory_stats(device) if memory.has_device_memory(device) else {}
        if "bytes_in_use" in stats and "bytes_limit" in stats:   # the pool is in place now (its first use)
            logger.info("device memory after start-up: %.2f GiB in use of %.2f GiB, largest free block %.2f GiB",
                        stats["bytes_in_use"] / memory.GiB, stats["bytes_limit"] / memory.GiB,
                        stats.get("largest_free_block_bytes", 0) / memory.GiB)
    return runner, max_model_len, num_blocks


def load_draft_model(args: EngineArgs, spec, target: LoadedModel) -> LoadedModel:
    """speculative_config's draft model, on the target's devices, refused unless it shares the
    target's vocabulary."""
    loaded = load_model(spec.model, args.dtype, args.revision, attention_backend=target.model.attention_backend,
                        scan_layers=args.scan_layers, shard_plan=target.model.shard_plan,
                        quantization=args.quantization, hub=HubOptions(args.trust_remote_code,
                                                                        download_dir=args.download_dir))
    if loaded.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config model {spec.model!r} has a vocabulary of {loaded.config.vocab_size} "
                         f"tokens, the target {target.config.vocab_size}: the draft must share the target's tokenizer")
    return loaded


def build_draft_proposer(args: EngineArgs, draft: LoadedModel, num_blocks: int, max_model_len: int,
                         use_tqdm: bool = True):
    """The draft model's runner, with a KV pool of the target's block count and block size (indexed
    by the target's block ids), its step variants compiled like the target's."""
    from jaxpaged.engine.spec_decode import DraftModelProposer
    runner = ModelRunner(draft.model, num_blocks, args.block_size, max_model_len, args.max_num_seqs,
                         args.batched_tokens(max_model_len), max_logprobs=0,
                         compiler_options=xla_compiler_options(args.optimization_level), greedy_only=True)
    if args.compile_on_startup:
        from tqdm.auto import tqdm
        shapes = runner.warmup_shapes()
        with tqdm(total=len(shapes), desc=f"Compiling {len(shapes)} draft step variants", disable=not use_tqdm) as bar:
            runner.warmup(shapes, bar)
    return DraftModelProposer(runner, args.block_size)


def build_scheduler(args: EngineArgs, runner: ModelRunner, num_blocks: int, max_model_len: int, model_config):
    """(SchedulerConfig, KVCacheManager, Scheduler) of an engine over this runner: its host pools (swap
    space, the prefix cache's host tier) and what preemption_mode="auto" weighs (the host copy rate)."""
    from jaxpaged.core.host_cache import HostPrefixCache
    from jaxpaged.core.kv_cache_manager import KVCacheManager
    from jaxpaged.core.preemption import PreemptionCost
    from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
    from jaxpaged.runner.batch_builder import next_bucket

    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.batched_tokens(max_model_len),
        max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
        preemption_mode=args.preemption_mode, max_loras=args.max_loras if args.enable_lora else 0,
        policy=args.scheduling_policy)
    host_cache = None
    if runner.host_cache_slots:   # batches as the runner moves blocks: at most max_moved_blocks, bucketed
        host_cache = HostPrefixCache(runner.host_cache_slots, padded=lambda n: next_bucket(n, 4),
                                     max_batch=runner.max_moved_blocks)
    # (MEAN and CLS pooling read every prompt token's hidden state: none may come from the prefix cache)
    caching = args.enable_prefix_caching and not (runner.pooler is not None and runner.pooler.every_token)
    kv_cache = KVCacheManager(num_blocks, args.block_size, caching,
                              num_host_blocks=runner.swap_space.num_host_blocks if runner.swap_space else 0,
                              rope_switch_len=model_config.rope_switch_len, host_cache=host_cache)
    cost = PreemptionCost(block_bytes=runner.block_bytes())
    if args.preemption_mode == "auto" and runner.swap_space is not None:
        cost.copy_bytes_per_s = runner.measure_copy_rate()
    return config, kv_cache, Scheduler(config, kv_cache, cost)
