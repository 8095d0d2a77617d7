"""Converted checkpoints: the engine's weights as an orbax-checkpoint folder.

    OUT/
      jaxpaged.json          {"format": "jaxpaged-orbax", "version": 1, "dtype": ...}
      config.json            the Hugging Face config (tokenizer and generation_config.json beside it)
      weights/               orbax (tensorstore) checkpoint of the arrays below

The arrays are ours ([in, out] linears, cast to the converted dtype), with every layer stacked
on a leading [num_layers] axis and the fused weights kept as their parts (`wqkv.0` = q,
`wqkv.1` = k, `wqkv.2` = v, `w_gate_up.0` = gate, `w_gate_up.1` = up): each part's shard for a
tensor-parallel device is then a plain slice, so a restore reads on each device only its own
slice (orbax restores straight into a `NamedSharding`). The parts are fused shard-major on the
devices afterwards, per shard (`shard_map`), with no cross-device traffic. KV heads that
tensor parallelism must repeat are read whole (they are the smallest weights) and repeated on
the devices.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.hf_names import F32_WEIGHTS
from jaxpaged.parallel import TOP_SPECS, ShardPlan, kv_head_replicas

FORMAT_FILE = "jaxpaged.json"
FORMAT = "jaxpaged-orbax"
VERSION = 1
_FUSED = ("wqkv", "bqkv", "w_gate_up", "b_gate_up", "w_experts_gate_up", "b_experts_gate_up")


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, FORMAT_FILE))


def _key(name: str, part: int | None = None) -> str:
    return name if part is None else f"{name}.{part}"


def save_converted(out: str, cfg: ModelConfig, hf_config, tokenizer, arrays: dict[str, np.ndarray], dtype: str,
                   source: str) -> None:
    """Write `arrays` (canonical_arrays' output) as an orbax checkpoint folder `out`, with the
    config, the tokenizer and the source's generation_config.json beside it."""
    import orbax.checkpoint as ocp

    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"output folder {out!r} exists and is not empty")
    os.makedirs(out, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(os.path.join(out, "weights")), arrays)
    hf_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "generation_config.json")):
        shutil.copy(os.path.join(source, "generation_config.json"), out)
    with open(os.path.join(out, FORMAT_FILE), "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "dtype": dtype, "architecture": cfg.architecture,
                   "num_layers": cfg.num_layers, "source": os.path.basename(os.path.normpath(source))}, f, indent=2)


def _part_spec(name: str, ndim: int, replicated_kv: bool, part: int) -> P:
    """Sharding of one stored (stacked) array for tensor parallelism."""
    from jaxpaged.parallel import LAYER_SPECS, TOP_SPECS

    if name in TOP_SPECS:
        return TOP_SPECS[name]
    spec = LAYER_SPECS[name]
    if name in ("wqkv", "bqkv") and part > 0 and replicated_kv:
        return P()   # k and v are read whole and repeated on the devices
    return P(None, *spec)


def load_converted(path: str, cfg: ModelConfig, dtype: str, scan_layers: bool, plan: ShardPlan) -> dict:
    """The engine's weights (convert_hf_weights' form) restored from a converted folder: each
    device reads its own slices; fused parts are joined shard-major on the devices."""
    import orbax.checkpoint as ocp

    tp = plan.size
    replicas = kv_head_replicas(cfg.num_kv_heads, tp)
    weights_dir = os.path.abspath(os.path.join(path, "weights"))
    with ocp.StandardCheckpointer() as ckpt:
        meta = ckpt.metadata(weights_dir)
        tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
        target = {}
        for key, info in tree.items():
            name, _, part = key.partition(".")
            spec = _part_spec(name, len(info.shape), replicas > 1, int(part or 0))
            # one device: still a device array (orbax restores numpy arrays without a sharding)
            sharding = plan.array_sharding(spec) or SingleDeviceSharding(plan.local_device)
            target[key] = jax.ShapeDtypeStruct(tuple(info.shape), info.dtype, sharding=sharding)
        stored = ckpt.restore(weights_dir, target)
    jdtype = jnp.dtype(dtype)
    weights = {name: stored[name].astype(jdtype) for name in TOP_SPECS if name in stored}
    stacks = {}
    names = sorted({key.partition(".")[0] for key in stored if key not in weights})
    for name in names:
        if name in _FUSED:
            parts = [stored[_key(name, j)] for j in range(3 if name in ("wqkv", "bqkv") else 2)]
            if name in ("wqkv", "bqkv") and replicas > 1:
                parts = [parts[0]] + [_repeat_heads(p, cfg.num_kv_heads, replicas, plan, name) for p in parts[1:]]
            stacks[name] = _fuse(parts, plan, P(None, *plan.weight_spec(name, False))).astype(jdtype)
        else:
            stacks[name] = stored[name].astype(jnp.float32 if name in F32_WEIGHTS else jdtype)
    if scan_layers:
        weights["layers"] = stacks
    else:
        split = jax.jit(lambda a: [a[i] for i in range(cfg.num_layers)])
        per_name = {name: split(a) for name, a in stacks.items()}
        weights["layers"] = [{name: per_name[name][i] for name in per_name} for i in range(cfg.num_layers)]
    return weights


def _repeat_heads(x: jax.Array, num_heads: int, replicas: int, plan: ShardPlan, name: str) -> jax.Array:
    """[..., heads * head_dim] -> [..., heads * replicas * head_dim] (h0 h0 h1 h1 ...), column-sharded."""
    def repeat(x):
        per_head = x.shape[-1] // num_heads
        x = x.reshape(x.shape[:-1] + (num_heads, per_head))
        return jnp.repeat(x, replicas, axis=-2).reshape(x.shape[:-2] + (num_heads * replicas * per_head,))
    out = plan.array_sharding(P(None, *plan.weight_spec(name, False)))
    return jax.jit(repeat, out_shardings=out)(x)


def _fuse(parts: list[jax.Array], plan: ShardPlan, spec: P) -> jax.Array:
    """Concatenate on the last axis shard-major: each device joins its own slices of the parts."""
    def concat(*xs):
        return jnp.concatenate(xs, axis=-1)
    if plan.mesh is None:
        return jax.jit(concat)(*parts)
    return jax.jit(jax.shard_map(concat, mesh=plan.mesh, in_specs=(spec,) * len(parts), out_specs=spec))(*parts)


def canonical_arrays(get, has, cfg: ModelConfig, np_dtype) -> dict[str, np.ndarray]:
    """Hugging Face tensors -> the stored arrays: our [in, out] layout, layers stacked, fused
    weights as their parts (see the module docstring). Host memory: about two copies of the weights
    (the per-layer arrays, then their stacks)."""
    from jaxpaged.models.hf_names import (_hf_layer_sources, hf_part_shape, hf_reader, hf_tensor, hf_to_ours,
                                          hf_top_sources)
    from jaxpaged.models.llama import layer_weight_shapes, weight_shapes

    if not cfg.uniform_layers:
        raise ValueError(f"a converted folder stacks the layers; this {cfg.architecture} has dense layers "
                         f"{list(cfg.dense_layers)} among its expert layers: serve its checkpoint as it is")
    get, has = hf_reader(cfg, get, has)
    shapes = weight_shapes(cfg)
    arrays = {}
    for name, hf_name in hf_top_sources(cfg).items():   # (the LM head [out, in] -> ours [in, out])
        value = hf_tensor(get, has, hf_name, shapes[name][::-1] if name == "lm_head" else shapes[name])
        arrays[name] = np.ascontiguousarray(value.T if name == "lm_head" else value).astype(np_dtype)
    layer_shapes = layer_weight_shapes(cfg)
    stacked: dict[str, list[np.ndarray]] = {}
    for i in range(cfg.num_layers):
        for name, hf_names in _hf_layer_sources(cfg, i).items():
            for j, hf_name in enumerate(hf_names):
                shape = hf_part_shape(cfg, name, layer_shapes[name], len(hf_names), j)
                value = hf_tensor(get, has, hf_name, shape)
                value = hf_to_ours(value, name)
                key = _key(name, j) if name in _FUSED else name
                stacked.setdefault(key, []).append(np.ascontiguousarray(value).astype(np_dtype))
    for key, values in stacked.items():
        arrays[key] = np.stack(values)
    return arrays

