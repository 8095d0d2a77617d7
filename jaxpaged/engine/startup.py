"""Engine start-up: load the model and tokenizer, size the KV pool, compile the step buckets."""

import logging
import os

import jax

from jaxpaged.core.kv_cache_manager import cdiv
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.models.loader import LoadedModel, load_model
from jaxpaged.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30   # 1 GiB by default on CPU


def enable_compilation_cache() -> None:
    """Persist compiled executables across processes (start-up compiles become disk reads)."""
    path = os.environ.get("JAXPAGED_COMPILATION_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged", "jax"))
    if path and path != "0":
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def load_tokenizer(args: EngineArgs, loaded: LoadedModel):
    from transformers import AutoTokenizer
    if args.tokenizer is not None:
        return AutoTokenizer.from_pretrained(args.tokenizer)
    if loaded.source.endswith(".gguf"):
        from jaxpaged.models.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(loaded.source)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(loaded.source, n)) for n in names):
        logger.warning("no tokenizer in %s: only token-id prompts will work", loaded.source)
        return None
    return AutoTokenizer.from_pretrained(loaded.source)


def load_model_and_tokenizer(args: EngineArgs):
    model = args.model
    name = args.served_model_name
    if model is None:
        from jaxpaged.models.builtin import BUILTIN_MODEL_NAME, builtin_model_path
        model = builtin_model_path()
        name = name or BUILTIN_MODEL_NAME
    from pallas_kernels.backends import resolve_backend
    backend = resolve_backend(args.attention_backend)   # validates; auto is refined below on GPU
    loaded = load_model(model, args.dtype, args.revision, attention_backend=backend)
    if args.attention_backend == "auto" and jax.devices()[0].platform == "gpu":
        cfg = loaded.config
        loaded.model.attention_backend = resolve_backend(
            "auto", head_shape=(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            dtype=loaded.model.embed[...].dtype)
    tokenizer = load_tokenizer(args, loaded)
    return loaded, tokenizer, name or args.model


def _num_blocks(args: EngineArgs, loaded: LoadedModel, max_model_len: int, per_block: int) -> int:
    cfg = loaded.config
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    if args.kv_cache_memory_bytes is not None:
        return max(2, args.kv_cache_memory_bytes // per_block)
    device = jax.devices()[0]
    if device.platform == "cpu":
        wanted = args.max_num_seqs * cdiv(max_model_len, args.block_size) + 1
        return max(2, min(wanted, CPU_KV_CACHE_BYTES // per_block))
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    in_use = stats.get("bytes_in_use", 0)
    # room for activations and logits of the largest step
    reserve = (1 << 30) + 8 * args.batched_tokens(max_model_len) * (cfg.vocab_size + 4 * cfg.hidden_size)
    budget = int(limit * args.gpu_memory_utilization) - in_use - reserve
    if budget < 2 * per_block:
        raise ValueError(f"no device memory left for the KV cache (limit {limit} B, in use {in_use} B); "
                         "lower max_num_batched_tokens or raise gpu_memory_utilization")
    return budget // per_block


def build_runner(args: EngineArgs, loaded: LoadedModel, use_tqdm: bool = True):
    """Returns (runner, max_model_len, num_blocks)."""
    cfg = loaded.config
    model_max = cfg.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > model_max:
        raise ValueError(f"max_model_len ({args.max_model_len}) is larger than the model's "
                         f"max_position_embeddings ({model_max})")
    max_model_len = args.max_model_len or model_max
    per_block = ModelRunner.bytes_per_block(cfg, args.block_size, loaded.dtype)
    num_blocks = _num_blocks(args, loaded, max_model_len, per_block)
    capacity = (num_blocks - 1) * args.block_size
    if max_model_len > capacity:
        if args.max_model_len is not None:
            raise ValueError(f"max_model_len ({max_model_len}) is larger than the KV cache can hold "
                             f"({capacity} tokens in {num_blocks - 1} blocks of {args.block_size}); lower "
                             "max_model_len or give the cache more memory")
        max_model_len = capacity
    enable_compilation_cache()
    max_batched = args.batched_tokens(max_model_len)
    num_host_blocks = 0
    if args.preemption_mode == "swap":
        num_host_blocks = int(args.swap_space * (1 << 30)) // per_block
        if num_host_blocks < 1:
            logger.warning("swap_space %.3f GiB holds no block: preemption falls back to recompute",
                           args.swap_space)
    runner = ModelRunner(loaded.model, num_blocks, args.block_size, max_model_len, args.max_num_seqs,
                         max_batched, num_host_blocks=num_host_blocks)
    logger.info("KV cache: %d blocks of %d tokens (%d tokens), max_model_len %d", num_blocks - 1,
                args.block_size, capacity, max_model_len)
    if args.compile_on_startup:
        shapes = runner.warmup_shapes()
        from tqdm.auto import tqdm
        with tqdm(total=len(shapes), desc="Compiling step buckets", disable=not use_tqdm) as bar:
            runner.warmup(shapes, bar)
    return runner, max_model_len, num_blocks
