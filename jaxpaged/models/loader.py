"""Load a model from a Hugging Face id, a local folder or a .gguf file into our layout.

Hugging Face tensors (PyTorch names, [out, in] linear weights) are transposed, fused
(q|k|v, gate|up) and cast to the target dtype one layer at a time, and each layer goes to
the device at once: as its own arrays for the unrolled layer loop, or written in place into
preallocated [num_layers, ...] stacks for the scanned one (`scan_layers`). The host holds one
layer's tensors, the device one copy of the weights.
"""

import dataclasses
import functools
import json
import logging
import os
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.hub_options import HubOptions
from jaxpaged.models.hf_names import (EXPERT_WEIGHTS, F32_WEIGHTS, QUANTIZABLE, _hf_layer_sources, hf_part_shape,
                                        hf_reader, hf_tensor, hf_to_ours, hf_top_sources)
from jaxpaged.models.registry import model_class_for
from jaxpaged.models.qwen_vision import QwenVisionTower, has_qwen_vision_tower
from jaxpaged.models.vision import VisionTower, has_vision_tower
from jaxpaged.models.vision_language import is_vision_language
from jaxpaged.models.llama import layer_weight_shapes, weight_shapes
from jaxpaged.models.orbax_io import FORMAT_FILE, is_converted, load_converted
from jaxpaged.models.prequantized import checkpoint_quantization, fp8_reader
from jaxpaged.models.quantization import HostQuantized, QuantizedWeight, combine, quantize, resolve_quantization
from jaxpaged.parallel import ShardPlan, check_tensor_parallel, fuse_columns, kv_head_replicas, repeat_heads

logger = logging.getLogger(__name__)

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_CHECKPOINT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclasses.dataclass
class LoadedModel:
    model: Any               # LlamaFamilyForCausalLM
    config: ModelConfig
    hf_config: Any           # transformers.PretrainedConfig
    dtype: str               # "float32" | "bfloat16" | "float16"
    source: str              # local folder or .gguf path the weights came from
    quantization: str | None = None   # the weights' quantization: None, "int8", "fp8", "int4" or "gguf"
    vision: Any = None       # a LLaVA or Qwen2-VL checkpoint's vision tower (models/vision.py, qwen_vision.py)


def resolve_dtype(dtype: str, checkpoint_dtype: str, device=None) -> str:
    """The model's dtype: "auto" is the checkpoint's, float16 in place of bfloat16 on a GPU without
    bfloat16 arithmetic (compute capability below 8.0: T4, V100), as vLLM does."""
    from jaxpaged.kernels.backends import AMPERE, compute_capability
    capability = compute_capability(device)
    no_bfloat16 = capability is not None and capability < AMPERE
    if dtype == "auto":
        if checkpoint_dtype == "bfloat16" and no_bfloat16:
            logger.warning("this GPU (compute capability %s) has no bfloat16: the bfloat16 checkpoint runs in "
                           "float16", ".".join(map(str, capability)))
            return "float16"
        return checkpoint_dtype
    aliases = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
    dtype = aliases.get(dtype, dtype)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of auto, {', '.join(_DTYPES)}")
    if dtype == "bfloat16" and no_bfloat16:
        raise ValueError(f"dtype='bfloat16' needs a GPU of compute capability 8.0 or newer; this one has "
                         f"{'.'.join(map(str, capability))}: use dtype='float16' (or 'auto')")
    return dtype


def resolve_scan_layers(scan_layers: bool | None, cfg: ModelConfig | None = None) -> bool:
    """None = the scan wherever the layers are alike (`cfg.uniform_layers`), the unrolled loop for an MoE
    model with dense layers among its expert ones (scan_layers=True is then a ValueError): the scan's
    compile time is flat in depth, and on XLA CPU with jaxlib 0.11.2's YNNPACK matmuls the unrolled
    loop's decode steps are about as fast while its start-up takes twice as long (the throughput
    benchmark's workload, float32, no compilation cache: 152.8 against 155.1 ms/step, start-up
    155.5 against 78.4 s; docs/features.md). The unrolled loop is opt-in (`scan_layers=False`)."""
    uniform = cfg is None or cfg.uniform_layers
    if scan_layers and not uniform:
        raise ValueError(f"scan_layers=True needs layers of one shape; this {cfg.architecture} has dense layers "
                         f"{list(cfg.dense_layers)} among its expert layers: use scan_layers=False or None")
    return uniform if scan_layers is None else bool(scan_layers)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack: jax.Array, value: jax.Array, i: jax.Array) -> jax.Array:
    """stack [num_layers, ...] with stack[i] = value, in place (the stack is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stack, value, i, 0)


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the engine runs for tensor parallelism tp: KV heads repeated until every
    device holds whole heads (see jaxpaged.parallel)."""
    check_tensor_parallel(cfg, tp)
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv_head_replicas(cfg.num_kv_heads, tp))


def put_weight(plan: ShardPlan, name: str, value, stacked: bool = False):
    """A host weight (numpy, or the numpy arrays of a QuantizedWeight) on the plan's devices with its sharding."""
    spec = plan.weight_spec(name, stacked)
    if name == "embed" and isinstance(value, QuantizedWeight):   # kept as its LM head [hidden, vocab]
        spec = P(*reversed(tuple(spec)))
    return value.map_arrays(plan.put, spec) if isinstance(value, QuantizedWeight) else plan.put(value, spec)


def _empty_stack(plan: ShardPlan, name: str, num_layers: int, layer_value):
    """Zeros [num_layers, ...] shaped like one layer's device weight (every array of a QuantizedWeight)."""
    def zeros(a, spec):
        return plan.zeros((num_layers, *a.shape), a.dtype, spec)
    spec = plan.weight_spec(name, True)
    return layer_value.map_arrays(zeros, spec) if isinstance(layer_value, QuantizedWeight) else zeros(layer_value, spec)


def _as_layer_weight(name: str, value, quantization: str | None, np_dtype, tp: int):
    """A fused host weight in its device form: GGUF blocks packed, float quantized (`quantization`, the
    `QUANTIZABLE` weights), or cast."""
    if isinstance(value, HostQuantized):
        return value.packed()
    if quantization is not None and name in QUANTIZABLE:
        return quantize(value, quantization, tp).packed()
    return value.astype(np.float32 if name in F32_WEIGHTS else np_dtype)


def convert_hf_weights(get: Callable[[str], np.ndarray], has: Callable[[str], bool], cfg: ModelConfig,
                       dtype: str, scan_layers: bool, plan: ShardPlan = ShardPlan(),
                       quantization: str | None = None) -> dict:
    """Hugging Face state dict (read through `get`) -> our weights on the device, in `dtype`.

    `weights["layers"]` is a dict of stacked [num_layers, ...] arrays when `scan_layers`, else a
    list of per-layer dicts (see `LlamaFamilyForCausalLM`). With a mesh (`plan`), each array is
    placed with its Megatron sharding, the fused columns shard-major and KV heads repeated for
    `sharded_config(cfg, plan.size)` (see jaxpaged.parallel). Raises ValueError naming the tensor
    when one is missing or has the wrong shape.

    Tensors that `get` returns as `HostQuantized` (GGUF blocks) stay quantized; `quantization`
    ("int8", "fp8", "int4") quantizes the float matmul weights of the layers (see
    jaxpaged.models.quantization).
    """
    np_dtype = _DTYPES[dtype]
    tp = plan.size
    replicas = kv_head_replicas(cfg.num_kv_heads, tp)
    shapes = weight_shapes(cfg)
    get, has = hf_reader(cfg, get, has)
    if quantization is not None and cfg.is_moe:
        logger.info("quantization=%r applies to attention and dense MLP weights; the experts stay in %s",
                    quantization, dtype)

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return hf_tensor(get, has, name, shape)

    def put(name: str, value, stacked: bool = False):
        return put_weight(plan, name, value, stacked)

    weights: dict = {}
    for name, hf_name in hf_top_sources(cfg).items():
        if name == "lm_head":   # [out, in] -> ours [in, out]
            value = fetch(hf_name, shapes[name][::-1]).T
        else:
            value = fetch(hf_name, shapes[name])
            value = value.T if name == "embed" and isinstance(value, HostQuantized) else value   # as its LM head
        weights[name] = put(name, value.packed() if isinstance(value, HostQuantized)
                            else np.ascontiguousarray(value).astype(np_dtype))

    stacks: dict = {}
    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        layer_shapes = layer_weight_shapes(sharded_config(cfg, tp), i)
        hf_shapes = layer_weight_shapes(cfg, i)
        for name, hf_names in _hf_layer_sources(cfg, i).items():
            shape = layer_shapes[name]
            parts = [fetch(n, hf_part_shape(cfg, name, hf_shapes[name], len(hf_names), j))
                     for j, n in enumerate(hf_names)]
            axis = len(shape) - 1    # a linear's output columns (after the transpose), or a bias
            parts = [hf_to_ours(p, name) for p in parts]   # linear: [out, in] -> [in, out]
            if any(isinstance(p, HostQuantized) for p in parts) and not all(
                    isinstance(p, HostQuantized) and p.kind == parts[0].kind for p in parts):
                parts = [p.dequantize() if isinstance(p, HostQuantized) else p for p in parts]   # mixed types
            if name in ("wqkv", "bqkv"):   # K and V heads repeated until each device holds whole heads
                parts = [parts[0]] + [combine([p], lambda a: repeat_heads(a[0], cfg.num_kv_heads, replicas, axis))
                                      for p in parts[1:]]
            column_tp = 1 if name in EXPERT_WEIGHTS else tp   # experts shard by expert, whole
            value = combine(parts, lambda a: fuse_columns(a, column_tp, axis)) if len(parts) > 1 else parts[0]
            value = put(name, _as_layer_weight(name, value, quantization, np_dtype, tp))
            if scan_layers:
                if name not in stacks:
                    stacks[name] = _empty_stack(plan, name, cfg.num_layers, value)
                stacks[name] = jax.tree.map(lambda s, v: _set_layer(s, v, i), stacks[name], value)
            else:
                layer[name] = value
        layers.append(layer)
    weights["layers"] = stacks if scan_layers else layers
    return weights


def _local_folder(model: str, revision: str | None = None, weights: bool = True, cache_dir: str | None = None) -> str:
    """A local folder, or a hub id's snapshot (its weights too unless `weights` is False) in `cache_dir` (None:
    the hub's own cache)."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model {model!r} is a file but not a .gguf; pass a folder with config.json "
                         "and safetensors, a .gguf file, or a Hugging Face model id")
    if model.startswith((".", "/")) or model.count("/") > 1:
        raise FileNotFoundError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        patterns = ["*.json", "*.model", "*.txt", "*.jinja"] + (["*.safetensors"] if weights else [])
        return snapshot_download(model, revision=revision, allow_patterns=patterns, cache_dir=cache_dir)
    except Exception as exc:  # offline, unknown id, gated repo...
        raise FileNotFoundError(
            f"could not find model {model!r} locally nor download it from the Hugging Face hub "
            f"({type(exc).__name__}: {exc})") from exc


def _dequantize_gguf_at_load(num_values: int, dtype: str) -> bool:
    """Whether "auto" de-quantizes a GGUF file's blocks once, at load (the same values;
    quantization='gguf' keeps them): yes unless the float weights would take more than a quarter of
    the memory they load into, the device's on a GPU (its allocator's limit), the host's elsewhere.
    Off a GPU the quantized matmul is XLA's de-quantize-then-matmul in every step (the built-in
    model's decode step took 2.5x as long); on a GPU the W8A16 / W4A16 kernel ran 2-5x slower than
    the bf16 matmul on one H200 (pallas_kernels/RESULTS.md), so kept blocks save memory, not time."""
    device = jax.devices()[0]
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    if device.platform == "gpu":
        where, capacity = "the device's memory", (device.memory_stats() or {}).get("bytes_limit", 0)
    else:
        where, capacity = "the host's memory", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_values * itemsize > capacity // 4:
        logger.info("GGUF blocks kept quantized on %s: float weights (%.1f GiB) would exceed a quarter of %s",
                    device.platform, num_values * itemsize / 2**30, where)
        return False
    logger.info("GGUF blocks de-quantized at load (%s: faster than its quantized matmul); quantization='gguf' "
                "keeps them", device.platform)
    return True


LOAD_FORMATS = ("auto", "dummy")
"""vLLM's load_format values jaxpaged takes: auto (the checkpoint's weights: safetensors, GGUF or a
converted folder) and dummy (random weights of the config's shapes, jaxpaged.models.dummy)."""


def load_model(model: str, dtype: str = "auto", revision: str | None = None,
               attention_backend: str = "reference", scan_layers: bool | None = None,
               shard_plan: ShardPlan = ShardPlan(), quantization: str | None = "auto",
               load_format: str = "auto", hub: HubOptions = HubOptions()) -> LoadedModel:
    """Load weights and config; `model` is a .gguf path, a local folder or a hub id.

    `scan_layers`: stack the layer weights and scan over them (True), keep one set of arrays
    per layer and unroll (False), or None: by platform (`resolve_scan_layers`). `shard_plan`:
    the devices to spread the weights over (tensor parallelism, see jaxpaged.parallel); the
    returned config is then `sharded_config` (KV heads repeated where tp exceeds them).
    `quantization`: see `jaxpaged.models.quantization.resolve_quantization` ("auto" keeps a GGUF
    file's Q8_0/Q4_0/Q4_1 matrices quantized only where float weights would not fit: see
    `_dequantize_gguf_at_load`). `load_format`: one of LOAD_FORMATS. `hub`: trust_remote_code and
    hf_overrides (models/hub_options.py).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(map(repr, LOAD_FORMATS))}, got {load_format!r}")
    if load_format == "dummy":
        from jaxpaged.models.dummy import load_dummy
        return load_dummy(model, dtype, revision, attention_backend, scan_layers, shard_plan, quantization, hub)
    requested_scan = scan_layers
    vision = None
    if model.endswith(".gguf"):
        from jaxpaged.models.gguf_loader import load_gguf, num_elements, open_gguf, quantized_tensor_types
        from jaxpaged.models.quantization import GGUF_NATIVE
        reader = open_gguf(model)   # the header once: the three calls below read it
        native = quantized_tensor_types(reader) & set(GGUF_NATIVE)
        requested = quantization
        quantization = resolve_quantization(quantization, "gguf" if native else None)
        dtype = resolve_dtype(dtype, "float32")
        if requested == "auto" and native and _dequantize_gguf_at_load(num_elements(reader), dtype):
            quantization = None
        hf_config, tensors = load_gguf(reader, keep_quantized=quantization == "gguf")
        hf_config = hub.override(hf_config)
        del reader
        cfg = model_config_from_hf(hf_config)
        scan_layers = resolve_scan_layers(requested_scan, cfg)
        weights = convert_hf_weights(tensors.__getitem__, tensors.__contains__, cfg, dtype, scan_layers, shard_plan,
                                     None if quantization == "gguf" else quantization)
        del tensors
        source = model
    elif is_converted(model):   # `jaxpaged convert`'s orbax folder: restored straight into the shardings
        hf_config = hub.config(model)
        cfg = model_config_from_hf(hf_config)
        scan_layers = resolve_scan_layers(requested_scan, cfg)
        check_tensor_parallel(cfg, shard_plan.size)
        with open(os.path.join(model, FORMAT_FILE)) as f:
            meta = json.load(f)
        if meta.get("format") != "jaxpaged-orbax" or meta.get("version") != 1:
            raise ValueError(f"{model!r} holds format {meta.get('format')!r} version {meta.get('version')!r}; this "
                             "jaxpaged reads jaxpaged-orbax version 1 (convert the model again)")
        dtype = resolve_dtype(dtype, meta["dtype"])
        quantization = resolve_quantization(quantization, None)
        weights = load_converted(model, cfg, dtype, scan_layers, shard_plan)
        if quantization is not None:
            weights = quantize_loaded(weights, quantization, shard_plan)
        source = model
    else:
        from jaxpaged.models.safetensors_io import Checkpoint
        folder = _local_folder(model, revision, cache_dir=hub.download_dir)
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"no config.json in model folder {folder!r}")
        hf_config = hub.config(folder)
        cfg = model_config_from_hf(hf_config)
        scan_layers = resolve_scan_layers(requested_scan, cfg)
        checkpoint = Checkpoint(folder)
        if cfg.tie_word_embeddings and is_vision_language(hf_config) and \
                hf_reader(cfg, checkpoint.get, checkpoint.__contains__)[1]("lm_head.weight"):
            # a composite config's tie_word_embeddings defaults to True (Mistral3's) where its checkpoint has
            # its own head: transformers keeps that head, and so do we
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        dtype = resolve_dtype(dtype, _CHECKPOINT_DTYPES[checkpoint.dtype_name()])
        get, method = checkpoint.get, checkpoint_quantization(hf_config)
        quantization = resolve_quantization(quantization, method)
        if method == "mxfp4" and cfg.architecture == "GptOssForCausalLM" and quantization in (method, None):
            quantization = method = None   # no MXFP4 kernel yet: hf_reader de-quantizes the experts as it reads them
        if method is not None and quantization in (method, None):   # kept, or de-quantized: read with its scales
            if method != "fp8":
                raise ValueError(f"{folder!r} is quantized as {method!r}, which jaxpaged cannot load; pre-quantized "
                                 "checkpoints it reads: fp8 (transformers' fp8 and compressed-tensors float8), "
                                 "gpt-oss's mxfp4 experts (de-quantized at load), and GGUF files")
            get = fp8_reader(checkpoint.get, checkpoint.__contains__, dequantize=quantization is None)
        weights = convert_hf_weights(get, checkpoint.__contains__, cfg, dtype, scan_layers, shard_plan,
                                     None if quantization == method else quantization)
        source = folder
        if has_vision_tower(hf_config):
            vision = VisionTower(hf_config, checkpoint.get, checkpoint.__contains__, _DTYPES[dtype],
                                 shard_plan.devices[0])
        elif has_qwen_vision_tower(hf_config):
            vision = QwenVisionTower(hf_config, checkpoint.get, checkpoint.__contains__, _DTYPES[dtype],
                                     shard_plan.devices[0])
    model_cls = model_class_for(cfg.architecture)
    cfg = sharded_config(cfg, shard_plan.size)
    return LoadedModel(model_cls(cfg, weights, attention_backend, shard_plan), cfg, hf_config, dtype, source,
                       quantization, vision)


def quantize_loaded(weights: dict, quantization: str, plan: ShardPlan) -> dict:
    """Quantize the matmul weights of device-resident layers (a converted folder's), through the host."""
    def one(name: str, value: jax.Array, stacked: bool):
        host = np.asarray(jax.device_get(value), np.float32)
        if not stacked:
            return put_weight(plan, name, quantize(host, quantization, plan.size).packed())
        per_layer = [quantize(layer, quantization, plan.size).packed() for layer in host]
        stack = jax.tree.map(lambda *arrays: np.stack(arrays), *per_layer)
        return put_weight(plan, name, stack, stacked=True)

    layers = weights["layers"]
    if isinstance(layers, dict):
        layers = {k: one(k, v, True) if k in QUANTIZABLE else v for k, v in layers.items()}
    else:
        layers = [{k: one(k, v, False) if k in QUANTIZABLE else v for k, v in layer.items()} for layer in layers]
    return {**weights, "layers": layers}


def convert_checkpoint(model: str, out: str, dtype: str = "auto", revision: str | None = None) -> str:
    """Write `model` (a .gguf path, a local folder or a hub id) as a converted orbax folder `out`
    (jaxpaged.models.orbax_io) that load_model restores straight into any tensor-parallel layout."""
    from jaxpaged.models.orbax_io import canonical_arrays, save_converted

    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):   # before minutes of reading
        raise ValueError(f"output folder {out!r} exists and is not empty")
    tokenizer = None
    if model.endswith(".gguf"):
        from jaxpaged.models.gguf_loader import load_gguf, load_gguf_tokenizer
        hf_config, tensors = load_gguf(model)
        get, has = tensors.__getitem__, tensors.__contains__
        dtype = resolve_dtype(dtype, "float32")
        tokenizer = load_gguf_tokenizer(model)
        source = model
    else:
        from transformers import AutoConfig, AutoTokenizer

        from jaxpaged.models.safetensors_io import Checkpoint
        source = _local_folder(model, revision)
        hf_config = AutoConfig.from_pretrained(source)
        checkpoint = Checkpoint(source)
        get, has = checkpoint.get, checkpoint.__contains__
        dtype = resolve_dtype(dtype, _CHECKPOINT_DTYPES[checkpoint.dtype_name()])
        if any(os.path.exists(os.path.join(source, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(source)
    cfg = model_config_from_hf(hf_config)
    save_converted(out, cfg, hf_config, tokenizer, canonical_arrays(get, has, cfg, _DTYPES[dtype]), dtype, source)
    return out
