"""Ragged paged attention as a Pallas kernel, lowered through Pallas' Triton backend.

Same contract as `reference.py`. One program per (query tile, kv head, kv split):

    grid = (num_tiles, kv_heads, num_kv_splits)
    program (t, h, s):  rows = the q_tile queries of tile t x the `group` heads of kv head h
                        walks split s of the pages its rows can see, `pages_per_step` at a time:
                          page ids <- block_tables[seq, page0 : page0 + pages_per_step]  (a few i32)
                          K, V     <- kv_pool[layer, 0|1, pages, h, :, :]  (pointer gather)
                        online softmax in fp32, writes (acc, max, sum) or the final rows

The split is dynamic (flash-decoding style): the number of splits is a static grid axis, but
each split's pages are cut in the kernel from the tile's own visible pages (`split_pages`),

    visible pages of a 5-page context, 3 splits:  | s0: p0 p1 | s1: p2 | s2: p3 p4 |

so a short context in a table sized for a long max_model_len is still spread over every
split instead of landing whole in the first. Every KV byte a tile needs is read once per
(tile, kv head): decodes read their context once, a prompt chunk of T tiles re-reads its
causal prefix up to T times. Pages after the tile's last query and before its sliding window
are never loaded. With more than one split the partial (acc, max, sum) go to HBM in fp32 and
a small jnp reduction merges them (split-K), which keeps the GPU busy when a decode batch has
few (tile, head) programs.

Triton needs power-of-two tensors and matmuls of at least 16 x 16 x 16, hence the limits
on block_size and head_dim and the padding of each tile's rows to at least 16.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxpaged.kernels.layout import fp8_values, is_fp8
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import validate_inputs
from jaxpaged.kernels.tiling import (FIRST_POS, KV_LEN, LAYER, NUM_QUERIES, SEQ, WINDOW, kernel_q_tile,
                                     merge_splits, sink_rows, split_pages, tile_queries, untile, visible_pages)

_MASKED = -1e30
_MAX_ROWS = 128          # rows (queries x heads) per program: the fp32 accumulator lives in registers
_STEP_BYTES = 16384     # bytes of one K (or V) tile per inner step
_TARGET_PROGRAMS = 264   # about two waves on a 132-SM H100/H200; more splits only add reduction work


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _validate_kernel_inputs(q, kv_pool, md, kv_chunk_blocks, num_kv_splits):
    validate_inputs(q, kv_pool, md)
    head_dim, block_size = q.shape[2], kv_pool.shape[4]
    group = q.shape[1] // kv_pool.shape[3]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256] for the Pallas kernel, got {head_dim}")
    if block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size (kv_pool.shape[4]) must be a power of two in [1, 256], got {block_size}")
    if group > _MAX_ROWS:
        raise ValueError(f"num_heads // kv_heads must be in [1, {_MAX_ROWS}], got {group}")
    if kv_chunk_blocks < 1:
        raise ValueError(f"kv_chunk_blocks must be >= 1, got {kv_chunk_blocks}")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be None or >= 1, got {num_kv_splits}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if kv_pool.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16) and not is_fp8(kv_pool.dtype):
        raise ValueError("kv_pool dtype must be float32, bfloat16, float16, or an fp8 pool's bytes (uint8: e4m3, "
                         f"int8: e5m2; see layout.kv_storage_dtype), got {kv_pool.dtype}")


def _dot(a, b, *, contract_b):
    """a @ b (or a @ b.T) with fp32 accumulation whatever the input dtype."""
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _attention_kernel(info_ref, tables_ref, cap_ref, q_ref, kv_ref, *out_refs, group, pages_per_step,
                      num_splits, max_blocks, sm_scale, use_cap, split_output):
    rows, head_dim = q_ref.shape
    block_size = kv_ref.shape[4]
    step_tokens = pages_per_step * block_size
    head, split = pl.program_id(1), pl.program_id(2)
    seq, kv_len, first_pos, num_queries = info_ref[SEQ], info_ref[KV_LEN], info_ref[FIRST_POS], info_ref[NUM_QUERIES]
    layer, window = info_ref[LAYER], info_ref[WINDOW]

    query = jnp.arange(rows, dtype=jnp.int32) // group       # row r holds query r // group, head r % group
    row_valid = query < num_queries
    q_pos = first_pos + query
    first, end = visible_pages(kv_len, first_pos, num_queries, window, block_size=block_size,
                               max_blocks=max_blocks)
    page_begin, page_stop = split_pages(first, end, split, num_splits)
    # A split starts anywhere, so its last step may reach past its pages (into the next split's,
    # or the table's padding): those keys are masked, and their loads go to the null block.
    key_stop = jnp.minimum(kv_len, page_stop * block_size)
    page_in_step = jnp.arange(pages_per_step, dtype=jnp.int32)

    q = q_ref[...]
    # an fp8 pool's pages are cast to q's dtype (its scales are applied outside, see layout.scaled_attention)
    compute_dtype = q.dtype if is_fp8(kv_ref.dtype) else jnp.promote_types(q.dtype, kv_ref.dtype)
    q = q.astype(compute_dtype)

    def step(j, carry):
        acc, m, l = carry
        page0 = page_begin + j * pages_per_step
        pages = tables_ref[seq, pl.ds(page0, pages_per_step)]
        pages = jnp.where(page0 + page_in_step < page_stop, pages, 0)
        k = fp8_values(kv_ref[layer, 0, pages, head, :, :]).reshape(step_tokens, head_dim).astype(compute_dtype)
        v = fp8_values(kv_ref[layer, 1, pages, head, :, :]).reshape(step_tokens, head_dim).astype(compute_dtype)
        k_pos = page0 * block_size + jnp.arange(step_tokens, dtype=jnp.int32)
        key_valid = k_pos < key_stop
        # Slots past kv_len hold stale data of earlier owners; zeroing V keeps a NaN there
        # from turning 0 * NaN into a poisoned row.
        v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
        s = _dot(q, k, contract_b=1) * sm_scale                          # [rows, step_tokens] fp32
        if use_cap:
            cap = cap_ref[0]
            s = jnp.where(cap > 0, cap * jnp.tanh(s / jnp.where(cap > 0, cap, 1.0)), s)
        mask = row_valid[:, None] & key_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        mask &= (window <= 0) | (q_pos[:, None] - k_pos[None, :] < window)
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(compute_dtype), v, contract_b=0)
        return acc, m_new, l

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), _MASKED, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    num_steps = (page_stop - page_begin + pages_per_step - 1) // pages_per_step
    acc, m, l = jax.lax.fori_loop(0, num_steps, step, (acc, m, l))
    if split_output:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        (out_ref,) = out_refs
        out_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)


def ragged_paged_attention_pallas(
    q: jax.Array, kv_pool: jax.Array, layer: jax.Array, md: AttentionMetadata,
    sliding_window: jax.Array | int = 0, soft_cap: float | jax.Array = 0.0, *, sm_scale: float,
    kv_chunk_blocks: int = 8,             # pages per inner step at most (a power of two, >= 16 keys)
    interpret: bool = False,              # run on CPU through the Pallas interpreter
    num_kv_splits: int | None = None,     # programs per (tile, kv head) along the context; None = auto
    sinks: jax.Array | None = None,       # [num_heads] attention sinks (gpt-oss), added as the splits merge
) -> jax.Array:
    """Attention of a ragged batch over the paged pool (backends.AttentionFn); pure, returns a new array.

    Raises ValueError for shapes, dtypes or sizes the kernel cannot handle.
    """
    _validate_kernel_inputs(q, kv_pool, md, kv_chunk_blocks, num_kv_splits)
    # A Python 0 soft cap is known at trace time: skip the tanh instead of masking it.
    use_cap = not (isinstance(soft_cap, (int, float)) and soft_cap == 0)
    return _attention(q, kv_pool, layer, md, sliding_window, soft_cap, sinks, sm_scale=sm_scale,
                      kv_chunk_blocks=kv_chunk_blocks, interpret=interpret, num_kv_splits=num_kv_splits,
                      use_cap=use_cap)


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_chunk_blocks", "interpret", "num_kv_splits",
                                             "use_cap"))
def _attention(q, kv_pool, layer, md, sliding_window, soft_cap, sinks, *, sm_scale, kv_chunk_blocks, interpret,
               num_kv_splits, use_cap):
    num_tokens, num_heads, head_dim = q.shape
    kv_heads, block_size = kv_pool.shape[3], kv_pool.shape[4]
    group = num_heads // kv_heads
    num_seqs, max_blocks = md.block_tables.shape

    rows = max(16, _next_pow2(kernel_q_tile(md.q_tile, group, _MAX_ROWS) * group))
    tiles = tile_queries(q, md, layer, sliding_window, kv_heads=kv_heads, max_rows=_MAX_ROWS, rows=rows)
    num_tiles = tiles.info.shape[0]
    # A step gives Triton's dot at least 16 keys; K and V tiles past ~16 KiB each (and their
    # per-element pointers) no longer fit in registers and spill.
    itemsize = max(q.dtype.itemsize, kv_pool.dtype.itemsize)
    budget_pages = max(1, _STEP_BYTES // (head_dim * itemsize * block_size))
    pages_per_step = max(-(-16 // block_size), _floor_pow2(min(kv_chunk_blocks, budget_pages)))
    total_steps = pl.cdiv(max_blocks, pages_per_step)
    if num_kv_splits is None:
        # Past total_steps splits even the longest context walks one step per split: more only add merging.
        num_kv_splits = max(1, min(total_steps, _TARGET_PROGRAMS // (num_tiles * kv_heads)))
    # A step starts at any page before max_blocks: the padded columns keep its table read in bounds.
    tables = jnp.pad(md.block_tables.astype(jnp.int32), ((0, 0), (0, pages_per_step - 1)))
    cap = jnp.asarray(soft_cap, jnp.float32).reshape(1)

    split_output = num_kv_splits > 1 or sinks is not None
    if split_output:
        out_shape = [jax.ShapeDtypeStruct((num_kv_splits, num_tiles, kv_heads, rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((num_kv_splits, num_tiles, kv_heads, rows), jnp.float32),
                     jax.ShapeDtypeStruct((num_kv_splits, num_tiles, kv_heads, rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, rows, head_dim), lambda t, h, s: (s, t, h, 0, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda t, h, s: (s, t, h, 0)),
                     pl.BlockSpec((None, None, None, rows), lambda t, h, s: (s, t, h, 0))]
    else:
        out_shape = jax.ShapeDtypeStruct((num_tiles, kv_heads, rows, head_dim), q.dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda t, h, s: (t, h, 0, 0))

    kernel = functools.partial(
        _attention_kernel, group=group, pages_per_step=pages_per_step, num_splits=num_kv_splits,
        max_blocks=max_blocks, sm_scale=sm_scale, use_cap=use_cap, split_output=split_output)
    # An accumulator of 8K+ fp32, or a page bigger than the K/V budget: spread it over 8 warps.
    big = rows * head_dim >= 64 * 128 or pages_per_step * block_size * head_dim * itemsize > _STEP_BYTES
    result = pl.pallas_call(
        kernel,
        grid=(num_tiles, kv_heads, num_kv_splits),
        in_specs=[pl.BlockSpec((None, 8), lambda t, h, s: (t, 0)),
                  pl.BlockSpec(tables.shape, lambda t, h, s: (0, 0)),
                  pl.BlockSpec((1,), lambda t, h, s: (0,)),
                  pl.BlockSpec((None, None, rows, head_dim), lambda t, h, s: (t, h, 0, 0)),
                  pl.BlockSpec(kv_pool.shape, lambda t, h, s: (0,) * 6)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pl_triton.CompilerParams(num_warps=8 if big else 4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention",
    )(tiles.info, tables, cap, tiles.q_tiles, kv_pool)

    sink = None if sinks is None else sink_rows(sinks, kv_heads, rows)
    out = merge_splits(*result, sink) if split_output else result
    return untile(out, tiles, num_heads, q.dtype)
