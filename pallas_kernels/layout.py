"""Layout of the paged KV pool and the scatter that writes a step's new K/V into it.

The pool is one array for all layers:

    kv_pool[layer, 0 (K) | 1 (V), block_id, kv_head, offset_in_block, head_dim]

A token's slot is `block_id * block_size + offset`. Block 0 is the null block: padding
tokens never write anywhere (slot -1 is dropped) and padded block-table entries point at
block 0, whose contents are always masked out by `kv_lens`.

One array (rather than one per layer) lets the model scan over layers with the pool in
the loop carry, updated in place, and lets swap/copy move a block of every layer at once.
Heads are outside the offset so that each (block, kv head) page is one contiguous
[block_size, head_dim] tile: attention reads keys of one head as a plain matrix, without
a transpose or a strided gather.
"""

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's kv_cache_dtype values: auto = the model dtype; fp8 is fp8_e4m3 (float8_e4m3fn)."""
_FP8 = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
# An fp8 pool holds its values' bytes: XLA (CPU at least) has no fp8 scatter and widens the whole pool
# for one (measured: 228 ms a layer against 0.02 ms in place), and a bitcast of the pool is a copy too.
# The byte type names the fp8 type: uint8 holds float8_e4m3fn, int8 float8_e5m2.
_FP8_STORAGE = {jnp.dtype(jnp.uint8): jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.int8): jnp.dtype(jnp.float8_e5m2)}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The pool's element type for a kv_cache_dtype: the model dtype, or the bytes of an fp8 type."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in _FP8:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    fp8 = jnp.dtype(_FP8[kv_cache_dtype])
    return next(storage for storage, kind in _FP8_STORAGE.items() if kind == fp8)


def fp8_type(storage_dtype):
    """The fp8 type a pool of this dtype holds (see kv_storage_dtype), or None for a float pool."""
    return _FP8_STORAGE.get(jnp.dtype(storage_dtype))


def is_fp8(storage_dtype) -> bool:
    return fp8_type(storage_dtype) is not None


def fp8_values(pages: jax.Array) -> jax.Array:
    """Pages read from an fp8 pool as their fp8 values (a bitcast of the bytes); other pages as they are."""
    kind = fp8_type(pages.dtype)
    return pages if kind is None else jax.lax.bitcast_convert_type(pages, kind)


def as_storage(values: jax.Array, storage_dtype) -> jax.Array:
    """fp8 values as the bytes an fp8 pool stores."""
    return jax.lax.bitcast_convert_type(values, jnp.dtype(storage_dtype))


def kv_pool_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)


def gather_pages(kv_pool: jax.Array, layer: jax.Array, kv: int, block_ids: jax.Array) -> jax.Array:
    """[*block_ids.shape, kv_heads, block_size, head_dim]: the K (kv 0) or V (kv 1) pages of these blocks
    of `layer`, gathered straight from the 6-D pool. Block ids must be in range (padding points at block
    0): XLA's bounds clamping is skipped, which makes CPU gathers several times slower. Not from a
    [L * 2 * blocks, ...] reshape of the pool: with one KV head XLA lays that reshape out with the
    degenerate head axis outermost and copies the whole pool for it, every layer (as write_kv's)."""
    return kv_pool.at[layer, kv, block_ids].get(mode="promise_in_bounds")


def quantize_kv(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x / scale in the fp8 `dtype`, clipped to its finite range (e4m3fn has no infinity)."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)


def write_kv(kv_pool: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, kv_scale: jax.Array | None = None) -> jax.Array:
    """Scatter k, v ([T, kv_heads, head_dim]) into `layer` of the pool at `slot_mapping` (i32[T]), a
    non-finite V as 0 (see below).

    Pure: returns the updated pool. Slots < 0 (padding tokens) are dropped. Inside a jit
    whose pool is donated (or a loop carry) XLA performs the scatter in place. An fp8 pool
    stores the bytes of k / kv_scale[0] and v / kv_scale[1] (f32[2], this layer's scales; readers
    multiply back, see `scaled_attention`).
    """
    # A non-finite V is stored as 0. Attention masks keys past a sequence's length by zeroing their
    # weights, and 0 x inf is NaN: a block's slots past the end of the sequence that now holds it keep
    # an earlier owner's V (one that overflowed, say in float16), which would make the new owner's
    # output NaN. K needs nothing: masked scores are replaced, not multiplied.
    v = jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v))
    kind = fp8_type(kv_pool.dtype)
    if kind is not None:   # the values' bytes, scattered in place like any other pool's
        scale = jnp.ones((2,), jnp.float32) if kv_scale is None else kv_scale
        k = as_storage(quantize_kv(k, scale[0], kind), kv_pool.dtype)
        v = as_storage(quantize_kv(v, scale[1], kind), kv_pool.dtype)
    # One scatter into the 6-D pool, each update a head_dim row at (layer, K|V, block, head, offset). Not
    # into a [rows, head_dim] reshape of the pool: with one KV head (per device: MQA, or tp = kv heads) XLA
    # lays that reshape out with the degenerate head axis outermost and copies the whole pool twice a
    # layer (measured on CPU: 89 ms a call at 16k blocks against 0.02 ms in place).
    _, _, num_blocks, kv_heads, block_size, head_dim = kv_pool.shape
    num_tokens = slot_mapping.shape[0]
    block = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)   # out of bounds: dropped
    offset = slot_mapping % block_size
    heads = jnp.arange(kv_heads, dtype=slot_mapping.dtype)

    def positions(kv: int) -> jax.Array:   # [T * kv_heads, 5]
        parts = (jnp.asarray(layer, slot_mapping.dtype), jnp.asarray(kv, slot_mapping.dtype), block[:, None],
                 heads[None, :], offset[:, None])
        return jnp.stack([jnp.broadcast_to(x, (num_tokens, kv_heads)) for x in parts], -1).reshape(-1, 5)

    indices = jnp.concatenate([positions(0), positions(1)])
    values = jnp.concatenate([k.reshape(-1, head_dim), v.reshape(-1, head_dim)]).astype(kv_pool.dtype)
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0, 1, 2, 3, 4),
                                           scatter_dims_to_operand_dims=(0, 1, 2, 3, 4))
    return jax.lax.scatter(kv_pool, indices, values, dims, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def calibrated_kv_scale(kv_scale: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
                        dtype) -> jax.Array:
    """A layer's K and V scales (f32[2]) for an fp8 pool: kv_scale where set (> 0); where 0 (vLLM's
    calculate_kv_scales, not yet calibrated) the largest |K| and |V| of this batch's tokens over the fp8
    type's largest value, so the batch's values just fit. Non-finite values (an overflowed float16
    activation) do not count: an infinite scale would zero every value stored under it for good."""
    valid = (slot_mapping >= 0)[:, None, None]

    def largest(x):
        x = jnp.abs(x.astype(jnp.float32))
        return jnp.max(jnp.where(valid & jnp.isfinite(x), x, 0.0))

    amax = jnp.stack([largest(k), largest(v)])
    fresh = jnp.maximum(amax / float(jnp.finfo(fp8_type(dtype)).max), 1e-8)
    return jnp.where(kv_scale > 0, kv_scale, fresh)


def scaled_attention(attention, q: jax.Array, kv_pool: jax.Array, layer, md, sliding_window, kv_scale, **kwargs):
    """`attention` over a pool whose K and V are stored divided by kv_scale (f32[2]): the K scale is
    folded into the queries and the V scale into the output, so the kernels only cast the fp8 pages
    to the queries' dtype. A pool in the model dtype is read as it is."""
    if not is_fp8(kv_pool.dtype):
        return attention(q, kv_pool, layer, md, sliding_window, **kwargs)
    q = (q.astype(jnp.float32) * kv_scale[0]).astype(q.dtype)
    out = attention(q, kv_pool, layer, md, sliding_window, **kwargs)
    return (out.astype(jnp.float32) * kv_scale[1]).astype(q.dtype)
