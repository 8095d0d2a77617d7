"""Tensor parallelism: one engine's model spread over a mesh of devices, Megatron-style.

XLA's SPMD partitioner does the work: the weights are placed with `NamedSharding`s over a mesh
axis `model`, the jitted step keeps its single-device code, and XLA inserts the collectives
(an all-reduce after each row-parallel matmul, gathers for vocabulary-parallel logits).
Attention and the KV pool are the exception: the pool is sharded by KV heads and each device
writes and reads only its own heads, so that part runs per shard under `shard_map`
(`ShardPlan.attention`), with the single-device kernels unchanged.

Layout (global view, our [in, out] weights):

    wqkv, bqkv        columns  shard s holds [q heads of s | k heads of s | v heads of s]
    w_gate_up, b_..   columns  shard s holds [gate columns of s | up columns of s]
    w_up, b_up        columns  (an ungated MLP's)
    wo, w_down        rows     (the all-reduce follows)
    embed [V, d]      rows     (vocabulary-parallel)
    lm_head [d, V]    columns  (vocabulary-parallel; its bias with them)
    norms, bo, b_down replicated (norms' biases, routers, shared-expert gates, learned positions too)
    latent attention  wq, wq_b columns, w_uk / w_uv heads, wkv_a replicated (jaxpaged.models.mla)
    w_experts_*       axis 0 (experts, whole: expert parallelism, see jaxpaged.models.moe)
    kv_pool           axis 3 (KV heads)

The fused q/k/v and gate/up columns are stored shard-major (`fuse_columns`), so each device's
columns are contiguous and the layer splits them locally after a [tokens, tp, per shard]
reshape. At tp 1 that layout is the plain [q | k | v] and [gate | up].

When tp exceeds the KV heads (GQA/MQA), each KV head is repeated tp / kv_heads times at load
(`kv_head_replicas`): the model then has tp KV heads, one per device, and query head h still
reads original KV head h // (num_heads / kv_heads). The pool holds the repeated heads, so the
KV budget is per device.

tp 1 uses no mesh at all: the single-device path is exactly the code that ran before.
"""

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

MODEL_AXIS = "model"

# name -> partition spec of one layer's weight (a scanned stack prepends the layer axis, replicated)
LAYER_SPECS = {
    "input_norm": P(), "post_norm": P(), "q_norm": P(), "k_norm": P(),
    "wqkv": P(None, MODEL_AXIS), "bqkv": P(MODEL_AXIS),
    "wo": P(MODEL_AXIS, None), "bo": P(),
    "w_gate_up": P(None, MODEL_AXIS), "b_gate_up": P(MODEL_AXIS),
    "w_down": P(MODEL_AXIS, None), "b_down": P(),
    "w_up": P(None, MODEL_AXIS), "b_up": P(MODEL_AXIS), "input_norm_bias": P(), "post_norm_bias": P(),
    "attn_out_norm": P(), "mlp_out_norm": P(), "router": P(), "shared_gate": P(),
    # experts: each device holds num_experts / tp of them whole (expert parallelism, jaxpaged.models.moe)
    "w_experts_gate_up": P(MODEL_AXIS, None, None), "w_experts_down": P(MODEL_AXIS, None, None),
    "router_bias": P(), "b_experts_gate_up": P(MODEL_AXIS, None), "b_experts_down": P(MODEL_AXIS, None),
    "sinks": P(MODEL_AXIS),   # one per query head (gpt-oss), split as the heads are
    "router_correction": P(),
    # latent attention (jaxpaged.models.mla): the heads split, the latent's projection replicated
    "wq": P(None, MODEL_AXIS), "wq_a": P(), "q_a_norm": P(), "wq_b": P(None, MODEL_AXIS), "wkv_a": P(),
    "kv_a_norm": P(), "w_uk": P(MODEL_AXIS, None, None), "w_uv": P(MODEL_AXIS, None, None),
}
TOP_SPECS = {"embed": P(MODEL_AXIS, None), "lm_head": P(None, MODEL_AXIS), "final_norm": P(), "classifier": P(),
             "final_norm_bias": P(), "pos_embed": P(), "lm_head_bias": P(MODEL_AXIS)}
POOL_SPEC = P(None, None, None, MODEL_AXIS)      # [layers, 2, blocks, kv_heads, block_size, head_dim]


def check_tensor_parallel(cfg, tp: int) -> None:
    """ValueError naming tensor_parallel_size and the sizes this model allows."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    if tp == 1:
        return
    kv = cfg.num_kv_heads
    sizes = {"attention heads": cfg.num_heads, "vocabulary": cfg.vocab_size}
    if not cfg.is_moe or cfg.dense_layers:
        sizes["intermediate size"] = cfg.intermediate_size
    if cfg.is_moe:
        sizes["experts"] = cfg.num_experts
    if cfg.shared_expert_size:
        sizes["shared expert size"] = cfg.shared_expert_size

    # OLMo's k norm spans every KV head at once: its heads are not repeated (not built yet)
    repeats = not cfg.qk_norm_full

    def fits(t: int) -> bool:
        return all(n % t == 0 for n in sizes.values()) and (kv % t == 0 or (repeats and t % kv == 0))

    if not fits(tp):
        allowed = [t for t in range(1, cfg.num_heads + 1) if fits(t)]
        raise ValueError(
            f"tensor_parallel_size must divide the model's {', '.join(f'{k} ({n})' for k, n in sizes.items())}, "
            f"and divide {'or be a multiple of ' if repeats else ''}its {kv} KV heads: one of {allowed}, got {tp}")


def kv_head_replicas(num_kv_heads: int, tp: int) -> int:
    """How many times each KV head is repeated so that every device holds whole KV heads."""
    return tp // num_kv_heads if tp > num_kv_heads else 1


def fuse_columns(parts: list[np.ndarray], tp: int, axis: int) -> np.ndarray:
    """Concatenate parts (each split evenly into tp shards along `axis`) shard-major:
    [part0 shard0 | part1 shard0 | ... | part0 shard1 | ...]."""
    if tp == 1:
        return np.concatenate(parts, axis=axis)
    pieces = [np.split(p, tp, axis=axis) for p in parts]
    return np.concatenate([pieces[j][s] for s in range(tp) for j in range(len(parts))], axis=axis)


def repeat_heads(w: np.ndarray, num_heads: int, replicas: int, axis: int) -> np.ndarray:
    """Repeat each of `num_heads` head blocks along `axis` `replicas` times (h0 h0 h1 h1 ...)."""
    if replicas == 1:
        return w
    shape = w.shape
    per_head = shape[axis] // num_heads
    w = w.reshape(shape[:axis] + (num_heads, per_head) + shape[axis + 1:])
    w = np.repeat(w, replicas, axis=axis)
    return w.reshape(shape[:axis] + (num_heads * replicas * per_head,) + shape[axis + 1:])


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One engine's devices and how its arrays lie on them.

    `mesh`: tensor parallelism over the mesh's `model` axis. Without one, everything lives on
    `device`, or uncommitted on JAX's default device when that is None too (one replica on one
    device: nothing is placed or sharded)."""

    mesh: Mesh | None = None
    device: Any = None

    @classmethod
    def for_devices(cls, devices: list, pin: bool = True) -> "ShardPlan":
        """A mesh over `devices`, or with one device, that device (`pin`) or the default one."""
        if len(devices) == 1:
            return cls(None, devices[0] if pin else None)
        return cls(Mesh(np.asarray(devices), (MODEL_AXIS,)))

    @property
    def size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    @property
    def devices(self) -> list:
        if self.mesh is not None:
            return list(self.mesh.devices.flat)
        return [self.device or jax.devices()[0]]

    def array_sharding(self, spec: P):
        """Where an array with `spec` lies: a NamedSharding, one pinned device, or None (the default device)."""
        if self.mesh is not None:
            return NamedSharding(self.mesh, spec)
        return None if self.device is None else SingleDeviceSharding(self.device)

    def put(self, value, spec: P = P()):
        """value on this plan's devices with `spec` (replicated by default)."""
        return jax.device_put(value, self.array_sharding(spec))

    def make(self, fn, spec: P = P(), *args) -> jax.Array:
        """fn(*args) computed straight in its sharding (no host copy, no gather, nothing on another
        device); on the default device, as it comes."""
        sharding = self.array_sharding(spec)
        return fn(*args) if sharding is None else jax.jit(fn, out_shardings=sharding)(*args)

    def zeros(self, shape: tuple[int, ...], dtype, spec: P = P()) -> jax.Array:
        """Zeros created straight in their sharding."""
        return self.make(lambda: jax.numpy.zeros(shape, dtype), spec)

    def replicate(self, tree):
        """Every array of `tree` replicated on this plan's devices (unchanged on the default device).
        Across hosts each process gives its own copy of the (identical) values from the host."""
        sharding = self.array_sharding(P())
        if sharding is None:
            return tree
        if not sharding.is_fully_addressable:
            return jax.tree.map(lambda a: jax.device_put(np.asarray(a), sharding), tree)
        return jax.tree.map(lambda a: jax.device_put(a, sharding), tree)

    @property
    def local_device(self):
        """This process's first device of the plan (where host-built arrays start)."""
        return next(d for d in self.devices if d.process_index == jax.process_index())

    def weight_spec(self, name: str, stacked: bool) -> P:
        spec = TOP_SPECS[name] if name in TOP_SPECS else LAYER_SPECS[name]
        return P(None, *spec) if stacked else spec

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        """Inside a jit: pin x's sharding (no-op without a mesh)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def matmul(self, kernel, spec: P):
        """kernel(x, w) -> x @ w for a weight sharded as `spec`, run per shard (a pallas_call cannot be
        partitioned by XLA): column-parallel (P(None, model)) each device computes its output columns,
        row-parallel (P(model, None)) its input rows' partial sums, added over the devices, replicated (P():
        latent attention's projections) the whole product on every device."""
        if self.mesh is None:
            return kernel
        column = tuple(spec) == (None, MODEL_AXIS)
        replicated = all(axis is None for axis in tuple(spec))
        x_spec = P() if column or replicated else P(None, MODEL_AXIS)

        def per_shard(x, w):
            y = kernel(x, w)
            return y if column or replicated else jax.lax.psum(y, MODEL_AXIS)

        def call(x, w):
            return jax.shard_map(per_shard, mesh=self.mesh, in_specs=(x_spec, w.specs(spec)),
                                 out_specs=P(None, MODEL_AXIS) if column else P(), check_vma=False)(x, w)
        return call

    def attention(self, fn):
        """fn(kv_pool, q, k, v, sinks, *replicated) -> (kv_pool, out [T, heads, head_dim]) run per shard:
        each device writes and reads its own KV heads with its own query heads (and their sinks
        [heads], or None)."""
        if self.mesh is None:
            return fn
        heads = P(None, MODEL_AXIS)

        def call(kv_pool, q, k, v, sinks, *rest):   # (a None sinks is an empty tree: its spec covers nothing)
            return jax.shard_map(fn, mesh=self.mesh,
                                 in_specs=(POOL_SPEC, heads, heads, heads, P(MODEL_AXIS)) + (P(),) * len(rest),
                                 out_specs=(POOL_SPEC, heads), check_vma=False)(kv_pool, q, k, v, sinks, *rest)
        return call
