"""Layout of the paged KV pool and the scatter that writes a step's new K/V into it.

The pool is one array for all layers:

    kv_pool[layer, 0 (K) | 1 (V), block_id, offset_in_block, kv_head, head_dim]

A token's slot is `block_id * block_size + offset`. Block 0 is the null block: padding
tokens never write anywhere (slot -1 is dropped) and padded block-table entries point at
block 0, whose contents are always masked out by `kv_lens`.

One array (rather than one per layer) lets the model scan over layers with the pool in
the loop carry, updated in place, and lets swap/copy move a block of every layer at once.
"""

import jax
import jax.numpy as jnp


def kv_pool_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)


def pages_view(kv_pool: jax.Array) -> jax.Array:
    """[L * 2 * num_blocks, block_size, kv_heads, head_dim]: row (layer * 2 + kv) * num_blocks + block."""
    num_layers, two, num_blocks, block_size, kv_heads, head_dim = kv_pool.shape
    return kv_pool.reshape(num_layers * two * num_blocks, block_size, kv_heads, head_dim)


def write_kv(kv_pool: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
    """Scatter k, v ([T, kv_heads, head_dim]) into `layer` of the pool at `slot_mapping` (i32[T]).

    Pure: returns the updated pool. Slots < 0 (padding tokens) are dropped. Inside a jit
    whose pool is donated (or a loop carry) XLA performs the scatter in place.
    """
    num_layers, _, num_blocks, block_size, kv_heads, head_dim = kv_pool.shape
    slots_per_plane = num_blocks * block_size
    flat = kv_pool.reshape(num_layers * 2 * slots_per_plane, kv_heads, head_dim)
    out_of_bounds = flat.shape[0]
    base = layer * 2 * slots_per_plane
    k_rows = jnp.where(slot_mapping >= 0, base + slot_mapping, out_of_bounds)
    v_rows = jnp.where(slot_mapping >= 0, base + slots_per_plane + slot_mapping, out_of_bounds)
    rows = jnp.concatenate([k_rows, v_rows])
    values = jnp.concatenate([k, v]).astype(kv_pool.dtype)
    flat = flat.at[rows].set(values, mode="drop", unique_indices=False)
    return flat.reshape(kv_pool.shape)
