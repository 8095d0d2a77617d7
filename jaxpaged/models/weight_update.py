"""In-place weight updates under Hugging Face parameter names (RL rollouts, research loops).

The engine holds fused, transposed and possibly sharded weights (q|k|v and gate|up fused
shard-major, KV heads repeated under tensor parallelism, layers stacked for the scan). Each
Hugging Face tensor fills some columns of one engine weight: `update_targets` works out which,
by pushing column indices through the loader's own transforms (`repeat_heads`, `fuse_columns`),
and `apply_updates` writes them on the device with one donated scatter per engine weight and
layer, so memory grows by at most the tensor being written and no step recompiles (the arrays
keep their shapes, dtypes and shardings).

    model.layers.3.self_attn.k_proj.weight  [kv_size, hidden]
        -> state ("layers", "wqkv")[3][:, k columns]  (stacked)  or  ("layers", 3, "wqkv")
"""

import dataclasses
import functools
from typing import Iterable, Mapping

import jax
import numpy as np

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.quantization import QuantizedWeight
from jaxpaged.parallel import fuse_columns, kv_head_replicas, repeat_heads

_PART = 1 << 24   # index encoding: part * _PART + column


@dataclasses.dataclass(frozen=True)
class Target:
    path: tuple                 # the engine weight's path in the model state
    layer: int | None           # its index on axis 0 of a stacked [num_layers, ...] weight
    dst: np.ndarray | None      # the engine weight's columns (last axis) it fills; None: all of it
    src: np.ndarray | None      # the tensor's columns (after the transpose) that go there
    transpose: bool             # a linear weight: Hugging Face [out, in] -> our [in, out]
    shape: tuple[int, ...]      # the Hugging Face tensor's shape


def _column_maps(parts: list[int], kv_parts: tuple[int, ...], num_kv_heads: int, tp: int):
    """For a weight fused from parts of `parts[j]` columns: per part, (dst, src) column indices."""
    replicas = kv_head_replicas(num_kv_heads, tp)
    idx = [np.arange(n, dtype=np.int64)[None, :] + j * _PART for j, n in enumerate(parts)]
    idx = [repeat_heads(a, num_kv_heads, replicas, 1) if j in kv_parts else a for j, a in enumerate(idx)]
    fused = fuse_columns(idx, tp, 1)[0] if len(idx) > 1 else idx[0][0]
    out = []
    for j in range(len(parts)):
        dst = np.flatnonzero(fused // _PART == j)
        out.append((dst, fused[dst] % _PART))
    return out


def update_targets(cfg: ModelConfig, scan_layers: bool, tp: int) -> dict[str, Target]:
    """Hugging Face name -> where it lives in the engine (cfg: the checkpoint's config, before KV
    heads are repeated for tensor parallelism)."""
    from jaxpaged.models.llama import layer_weight_shapes, weight_shapes
    from jaxpaged.models.gpt_families import ARCHITECTURES as OWN_NAMES
    from jaxpaged.models.hf_names import _hf_layer_sources, hf_part_shape, hf_top_sources

    if cfg.is_moe or cfg.architecture in ("Phi3ForCausalLM",) + OWN_NAMES or cfg.rope_interleaved:
        raise ValueError(f"update_weights does not yet take {cfg.architecture}'s tensors (per-expert or fused "
                         "qkv/gate_up names, an interleaved rope's q/k, or GPT-2's, OPT's, GPT-NeoX's ... own names); "
                         "it updates the other dense families")
    shapes = weight_shapes(cfg)
    targets = {hf: Target((name,), None, None, None, name == "lm_head",   # (the LM head: [out, in])
                          shapes[name][::-1] if name == "lm_head" else shapes[name])
               for name, hf in hf_top_sources(cfg).items()}
    layer_shapes = layer_weight_shapes(cfg)
    for i in range(cfg.num_layers):
        for name, hf_names in _hf_layer_sources(cfg, i).items():
            ours = layer_shapes[name]
            hf_shapes = [hf_part_shape(cfg, name, ours, len(hf_names), j) for j in range(len(hf_names))]
            path = ("layers", name) if scan_layers else ("layers", i, name)
            layer = i if scan_layers else None
            linear = len(ours) == 2
            kv_parts = (1, 2) if name in ("wqkv", "bqkv") else ()
            maps = _column_maps([s[0] for s in hf_shapes], kv_parts, cfg.num_kv_heads, tp)
            for hf_name, shape, (dst, src) in zip(hf_names, hf_shapes, maps):
                whole = len(hf_names) == 1 and np.array_equal(dst, np.arange(ours[-1]))
                targets[hf_name] = Target(path, layer, None if whole else dst, None if whole else src, linear, shape)
    return targets


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(weight, layer, values):
    """weight[layer] = values, in place."""
    return jax.lax.dynamic_update_index_in_dim(weight, values.astype(weight.dtype), layer, 0)


@functools.partial(jax.jit, donate_argnums=0)
def _set_columns(weight, dst, values):
    """weight[..., dst] = values, in place."""
    return weight.at[..., dst].set(values.astype(weight.dtype))


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer_columns(weight, layer, dst, values):
    """weight[layer][..., dst] = values, in place."""
    current = jax.lax.dynamic_index_in_dim(weight, layer, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(weight, current.at[..., dst].set(values.astype(weight.dtype)), layer, 0)


def _write(weight: jax.Array, target: Target, values: np.ndarray) -> jax.Array:
    """The engine weight with `values` (already in its orientation and columns) written where
    `target` says; the old array is donated."""
    if target.layer is None and target.dst is None:
        return jax.device_put(values.astype(weight.dtype), weight.sharding)
    on = weight.sharding   # the small operands go replicated onto the weight's devices
    replicated = (jax.sharding.NamedSharding(on.mesh, jax.sharding.PartitionSpec())
                  if isinstance(on, jax.sharding.NamedSharding) else on)
    values = jax.device_put(values, replicated)
    if target.dst is None:
        out = _set_layer(weight, target.layer, values)
    else:
        dst = jax.device_put(target.dst.astype(np.int32), replicated)
        out = _set_columns(weight, dst, values) if target.layer is None else \
            _set_layer_columns(weight, target.layer, dst, values)
    return jax.device_put(out, on)


def _as_host(name: str, value) -> np.ndarray:
    array = np.asarray(jax.device_get(value) if isinstance(value, jax.Array) else value)
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype.name in ("bfloat16", "float8_e4m3fn")):
        raise ValueError(f"update_weights: {name} has dtype {array.dtype}; a floating-point array is expected")
    return array


def _at(state, path: tuple):
    for key in path:
        state = state[key]
    return state


def apply_updates(state, targets: dict[str, Target], weights: Mapping | Iterable, tied: bool) -> list[str]:
    """Write `weights` ((name, array) pairs or a mapping) into the model `state` (nnx.State, changed
    in place); returns the names written. Everything is checked before anything is written: a
    ValueError names the first unknown, misshapen, non-float or quantized parameter."""
    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    checked = []
    for name, value in items:
        if name == "lm_head.weight" and tied:
            continue   # the tied embedding's transpose: updated through model.embed_tokens.weight
        target = targets.get(name)
        if target is None:
            raise ValueError(f"update_weights: unknown parameter {name!r} (expected Hugging Face names such as "
                             f"'model.layers.0.self_attn.q_proj.weight')")
        array = _as_host(name, value)
        if tuple(array.shape) != target.shape:
            raise ValueError(f"update_weights: {name} has shape {list(array.shape)}, expected {list(target.shape)}")
        variable = _at(state, target.path)
        if isinstance(variable.get_value(), QuantizedWeight):
            raise ValueError(f"update_weights: {name} is held quantized; start the engine with quantization=None "
                             "to update its weights in place")
        checked.append((name, target, array, variable))
    for name, target, array, variable in checked:
        values = array.T if target.transpose else array
        if target.src is not None:
            values = values[..., target.src]
        weight = variable.get_value()
        variable.set_value(_write(weight, target, np.ascontiguousarray(values).astype(weight.dtype)))
    return [name for name, *_ in checked]
