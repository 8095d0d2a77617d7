"""The `cpu` attention backend: ragged paged attention through a native kernel on a CPU.

On a CPU the jnp reference gathers each chunk of pages into a copy and multiplies the copy (XLA:CPU
cannot fuse a gather into a dot), so attention costs the KV traffic twice over plus small batched
dots, and a mixed step pays a 16-token query tile for every decoding sequence. `cpu_attention.cc`
reads the pages where they lie instead, token by token (a prompt chunk's token is a decode over the
keys up to its position): an XLA FFI custom call in the native CPU library (cpu_native.py: built on
first use with the machine's C++ compiler and cached). It takes f32 queries and pools with up to
16 query heads per kv head, head_dim <= 256 and block_size <= 64; other steps (bf16 or fp8 pools,
larger shapes) run the reference. Where no compiler builds it, `auto` stays on the reference (logged
once) and `attention_backend="cpu"` is a ValueError. Against the reference (`python -m
benchmarks.cpu_attention`): 2-5x faster on decode, mixed and short-prompt steps, 0.7x on one
1024-token prompt (its tokens each walk their own pages)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels import cpu_native
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import ragged_paged_attention_reference, validate_inputs

TARGET = "jaxpaged_ragged_paged_attention"
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64   # the kernel's scratch sizes (cpu_attention.cc)


def supports(q: jax.Array, kv_pool: jax.Array) -> bool:
    """Whether the native kernel takes this step (else the reference does)."""
    _, _, _, kv_heads, block_size, head_dim = kv_pool.shape
    num_heads = q.shape[1]
    return (q.dtype == jnp.float32 and kv_pool.dtype == jnp.float32
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK)


def ragged_paged_attention_cpu(q: jax.Array, kv_pool: jax.Array, layer: jax.Array, md: AttentionMetadata,
                               sliding_window: jax.Array | int = 0, soft_cap: float | jax.Array = 0.0, *,
                               sm_scale: float, **reference_options) -> jax.Array:
    """backends.AttentionFn, with the reference's results (to f32 rounding)."""
    if not supports(q, kv_pool):
        return ragged_paged_attention_reference(q, kv_pool, layer, md, sliding_window, soft_cap, sm_scale=sm_scale,
                                                **reference_options)
    validate_inputs(q, kv_pool, md)
    if cpu_native.load() is None:
        raise RuntimeError("attention_backend='cpu' needs its native kernel, which did not build (see the log)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, kv_pool, jnp.asarray(layer, jnp.int32), md.kv_lens, md.block_tables, md.cu_q_lens,
                jnp.asarray(sliding_window, jnp.int32), jnp.asarray(soft_cap, jnp.float32),
                sm_scale=np.float32(sm_scale))
