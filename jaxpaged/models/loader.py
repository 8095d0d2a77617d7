"""Load a model from a Hugging Face id, a local folder or a .gguf file into our layout.

Hugging Face tensors (PyTorch names, [out, in] linear weights) are transposed, fused
(q|k|v, gate|up) and cast to the target dtype one layer at a time, and each layer goes to
the device at once: as its own arrays for the unrolled layer loop, or written in place into
preallocated [num_layers, ...] stacks for the scanned one (`scan_layers`). The host holds one
layer's tensors, the device one copy of the weights.
"""

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.registry import model_class_for
from jaxpaged.models.llama import layer_weight_shapes, weight_shapes

_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_CHECKPOINT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclasses.dataclass
class LoadedModel:
    model: Any               # LlamaFamilyForCausalLM
    config: ModelConfig
    hf_config: Any           # transformers.PretrainedConfig
    dtype: str               # "float32" | "bfloat16" | "float16"
    source: str              # local folder or .gguf path the weights came from


def resolve_dtype(dtype: str, checkpoint_dtype: str) -> str:
    if dtype == "auto":
        return checkpoint_dtype
    aliases = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
    dtype = aliases.get(dtype, dtype)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of auto, {', '.join(_DTYPES)}")
    return dtype


def resolve_scan_layers(scan_layers: bool | None) -> bool:
    """None = the scan everywhere: its compile time is flat in depth. On XLA CPU the unrolled
    loop runs decode steps 25-40% faster (XLA copies each layer's weights out of a scanned
    stack, see `jaxpaged.models.llama`) but compiles 5x slower per variant (10 s against 2 s for
    SmolLM2's 30 layers): start-up with the default buckets took 7 min cold against 142 s, so
    the unrolled loop is opt-in (`scan_layers=False`) for long CPU runs."""
    return True if scan_layers is None else bool(scan_layers)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack: jax.Array, value: jax.Array, i: jax.Array) -> jax.Array:
    """stack [num_layers, ...] with stack[i] = value, in place (the stack is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stack, value, i, 0)


def _hf_layer_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Our layer weight name -> the Hugging Face tensors (concatenated on the output dim) of layer i."""
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    sources = {
        "input_norm": [p + "input_layernorm.weight"],
        "post_norm": [p + "post_attention_layernorm.weight"],
        "wqkv": [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
        "wo": [attn + "o_proj.weight"],
        "w_gate_up": [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
        "w_down": [mlp + "down_proj.weight"],
    }
    if cfg.qkv_bias:
        sources["bqkv"] = [attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"]
    if cfg.o_bias:
        sources["bo"] = [attn + "o_proj.bias"]
    if cfg.mlp_bias:
        sources["b_gate_up"] = [mlp + "gate_proj.bias", mlp + "up_proj.bias"]
        sources["b_down"] = [mlp + "down_proj.bias"]
    if cfg.qk_norm:
        sources["q_norm"] = [attn + "q_norm.weight"]
        sources["k_norm"] = [attn + "k_norm.weight"]
    return sources


def convert_hf_weights(get: Callable[[str], np.ndarray], has: Callable[[str], bool], cfg: ModelConfig,
                       dtype: str, scan_layers: bool) -> dict:
    """Hugging Face state dict (read through `get`) -> our weights on the device, in `dtype`.

    `weights["layers"]` is a dict of stacked [num_layers, ...] arrays when `scan_layers`, else a
    list of per-layer dicts (see `LlamaFamilyForCausalLM`). Raises ValueError naming the tensor
    when one is missing or has the wrong shape.
    """
    np_dtype = _DTYPES[dtype]
    shapes = weight_shapes(cfg)
    layer_shapes = layer_weight_shapes(cfg)

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if not has(name):
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
        tensor = get(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor

    def linear_shape(name: str, ours: tuple[int, ...], parts: int, j: int) -> tuple[int, ...]:
        """PyTorch [out, in] shape of part j of a fused [in, out...] weight."""
        if name in ("wqkv", "bqkv"):
            out = (cfg.q_size, cfg.kv_size, cfg.kv_size)[j]
        else:
            out = ours[-1] // parts
        return (out, ours[0]) if len(ours) == 2 else (out,)

    weights: dict = {}
    weights["embed"] = jnp.asarray(fetch("model.embed_tokens.weight", shapes["embed"]).astype(np_dtype))
    weights["final_norm"] = jnp.asarray(fetch("model.norm.weight", shapes["final_norm"]).astype(np_dtype))
    if not cfg.tie_word_embeddings:
        head = fetch("lm_head.weight", shapes["lm_head"][::-1])
        weights["lm_head"] = jnp.asarray(np.ascontiguousarray(head.T).astype(np_dtype))

    stacks = ({name: jnp.zeros((cfg.num_layers, *shape), np_dtype) for name, shape in layer_shapes.items()}
              if scan_layers else {})
    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        for name, hf_names in _hf_layer_sources(cfg, i).items():
            shape = layer_shapes[name]
            parts = [fetch(n, linear_shape(name, shape, len(hf_names), j)) for j, n in enumerate(hf_names)]
            if len(shape) == 2:   # linear: [out, in] -> [in, out]
                value = np.concatenate([p.T for p in parts], axis=1).astype(np_dtype)
            else:
                value = np.concatenate(parts, axis=0).astype(np_dtype)
            if scan_layers:
                stacks[name] = _set_layer(stacks[name], value, i)
            else:
                layer[name] = jnp.asarray(value)
        layers.append(layer)
    weights["layers"] = stacks if scan_layers else layers
    return weights


def _local_folder(model: str, revision: str | None = None) -> str:
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model {model!r} is a file but not a .gguf; pass a folder with config.json "
                         "and safetensors, a .gguf file, or a Hugging Face model id")
    if model.startswith((".", "/")) or model.count("/") > 1:
        raise FileNotFoundError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=revision,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # offline, unknown id, gated repo...
        raise FileNotFoundError(
            f"could not find model {model!r} locally nor download it from the Hugging Face hub "
            f"({type(exc).__name__}: {exc})") from exc


def load_model(model: str, dtype: str = "auto", revision: str | None = None,
               attention_backend: str = "reference", scan_layers: bool | None = None) -> LoadedModel:
    """Load weights and config; `model` is a .gguf path, a local folder or a hub id.

    `scan_layers`: stack the layer weights and scan over them (True), keep one set of arrays
    per layer and unroll (False), or None: by platform (`resolve_scan_layers`).
    """
    scan_layers = resolve_scan_layers(scan_layers)
    if model.endswith(".gguf"):
        from jaxpaged.models.gguf_loader import load_gguf
        hf_config, tensors = load_gguf(model)
        cfg = model_config_from_hf(hf_config)
        dtype = resolve_dtype(dtype, "float32")
        weights = convert_hf_weights(tensors.__getitem__, tensors.__contains__, cfg, dtype, scan_layers)
        del tensors
        source = model
    else:
        from transformers import AutoConfig

        from jaxpaged.models.safetensors_io import Checkpoint
        folder = _local_folder(model, revision)
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"no config.json in model folder {folder!r}")
        hf_config = AutoConfig.from_pretrained(folder)
        cfg = model_config_from_hf(hf_config)
        checkpoint = Checkpoint(folder)
        dtype = resolve_dtype(dtype, _CHECKPOINT_DTYPES[checkpoint.dtype_name()])
        weights = convert_hf_weights(checkpoint.get, checkpoint.__contains__, cfg, dtype, scan_layers)
        source = folder
    model_cls = model_class_for(cfg.architecture)
    return LoadedModel(model_cls(cfg, weights, attention_backend), cfg, hf_config, dtype, source)
