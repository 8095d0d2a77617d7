"""Ragged paged attention as a Pallas kernel on Mosaic GPU (Hopper: TMA, wgmma).

Same contract as `reference.py` (backends.AttentionFn). One program, a CUDA block of one
warpgroup, per (query tile, kv head, kv split):

    grid = (num_tiles, kv_heads, num_kv_splits)
    rows  = the tile's queries x the `group` query heads of kv head h, padded to 64 (wgmma's M):
            a decode's group heads, or a prompt chunk's q_tile x group (tiling.py)
    walk  = split s of the pages those rows can see, 64 keys a step:
              page ids   <- block_tables[seq, ...]                (scalars read from GMEM)
              K, V       -> SMEM, one TMA copy per page (or 64-row slice of a bigger page),
                            `slots` steps in flight (issued slots - 1 steps ahead of the step computed)
              S = Q K^T  (wgmma, fp32) -> scale, soft cap, mask -> online softmax
              acc += P V (wgmma, P from registers, accumulating in place)
    out   = acc / sum (one split), or the fp32 (acc, max, sum) merged outside (split-K)

Decode rows use a few of the 64: a decode step is bound by the KV bytes it reads, not by the
tensor core; q and the output travel as a tile's real rows (rounded up to 8), not 64. GPU
interpret mode, which runs the tests on a CPU, reads both wgmma operands from SMEM and does not
interpret `run_state`: there P goes through SMEM into a fresh accumulator (`interpret=True`), the
one place the two paths differ; the GPU path is checked by Mosaic GPU's own lowering in the tests.

An fp8 pool's pages are copied as bytes and widened to q's dtype in SMEM before the dots (its
scales are applied outside, see layout.scaled_attention).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels.layout import fp8_type, is_fp8
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import num_query_tiles, validate_inputs
from jaxpaged.kernels.tiling import (FIRST_POS, KV_LEN, LAYER, NUM_QUERIES, SEQ, WINDOW, kernel_q_tile, merge_splits,
                                     sink_rows, split_pages, tile_queries, untile, visible_pages)

ROWS = 64                  # one warpgroup's wgmma tile
KEYS = 64                  # keys a step: P's rows are 128 bytes (one swizzle row) in 16 bits
_MASKED = -1e30
_SMEM_BYTES = 192 * 1024   # of a Hopper SM's 227 KiB: the walk's buffers (the output's come after them)
_MAX_SLOTS = 4
_TARGET_PROGRAMS = 264     # about two waves on a 132-SM H100/H200; more splits only add merging


def _swizzled(dtype):
    """SMEM transforms for a wgmma operand: rows in 128-byte tiles, 128-byte swizzle."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A call's static shape: each step takes KEYS keys in `copies` TMA copies of `chunk` rows (whole
    pages, or 64-row slices of bigger ones); `slots` steps in flight; `rows` of q and out in HBM."""
    chunk: int
    copies: int
    slots: int
    num_splits: int
    rows: int


def _plan(q, kv_pool, md, num_tiles, num_kv_splits, max_slots) -> _Plan:
    head_dim, block_size = q.shape[2], kv_pool.shape[4]
    dtype = jnp.dtype(q.dtype)
    chunk = min(block_size, KEYS)
    staged = 2 * KEYS * head_dim * dtype.itemsize if is_fp8(kv_pool.dtype) else 0
    fixed = ROWS * head_dim * dtype.itemsize + ROWS * KEYS * dtype.itemsize + staged
    slot_bytes = 2 * KEYS * head_dim * jnp.dtype(kv_pool.dtype).itemsize
    slots = min(max_slots, (_SMEM_BYTES - fixed) // slot_bytes)
    if slots < 2:   # not reached for head_dim <= 256 (two 64-key steps of K and V fit)
        raise ValueError(f"head_dim {head_dim} leaves no room for two steps of K and V in shared memory")
    if num_kv_splits is None:
        total_steps = -(-md.block_tables.shape[1] * block_size // KEYS)
        num_kv_splits = max(1, min(total_steps, _TARGET_PROGRAMS // (num_tiles * kv_pool.shape[3])))
    group = q.shape[1] // kv_pool.shape[3]
    rows = max(8, 1 << (kernel_q_tile(md.q_tile, group, ROWS) * group - 1).bit_length())
    return _Plan(chunk, KEYS // chunk, slots, num_kv_splits, rows)


def _validate(q, kv_pool, md, num_kv_splits, interpret):
    validate_inputs(q, kv_pool, md)
    head_dim, block_size = q.shape[2], kv_pool.shape[4]
    group = q.shape[1] // kv_pool.shape[3]
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if kv_pool.dtype != q.dtype and not is_fp8(kv_pool.dtype):
        raise ValueError(f"kv_pool dtype must be q's ({q.dtype}) or an fp8 pool's bytes (uint8: e4m3, int8: e5m2; "
                         f"see layout.kv_storage_dtype), got {kv_pool.dtype}")
    if q.dtype == jnp.float32 and not interpret:
        # fp32 wgmma (tf32) reads B only K-major: P V would need V transposed in SMEM.
        raise ValueError("the Mosaic GPU kernel runs bfloat16 or float16 on a GPU (q dtype float32 only in "
                         "interpret mode); use attention_backend='triton' or 'reference' for a float32 model")
    if head_dim * jnp.dtype(q.dtype).itemsize % 128 or head_dim > 256:
        raise ValueError(f"head_dim must be up to 256 with rows of a multiple of 128 bytes for the Mosaic GPU "
                         f"kernel (64, 128, 192 or 256 in bfloat16 or float16), got {head_dim} ({q.dtype})")
    if block_size < 8 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size (kv_pool.shape[4]) must be a power of two in [8, 256], got {block_size}")
    if group > ROWS:
        raise ValueError(f"num_heads // kv_heads must be in [1, {ROWS}], got {group}")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be None or >= 1, got {num_kv_splits}")


def ragged_paged_attention_mosaic(
    q: jax.Array, kv_pool: jax.Array, layer: jax.Array, md: AttentionMetadata,
    sliding_window: jax.Array | int = 0, soft_cap: float | jax.Array = 0.0, *, sm_scale: float,
    interpret: bool = False,              # run on a CPU in Mosaic GPU's interpret mode
    num_kv_splits: int | None = None,     # programs per (tile, kv head) along the context; None = auto
    max_slots: int = _MAX_SLOTS,          # steps of K and V in flight at most (SMEM permitting)
    sinks: jax.Array | None = None,       # [num_heads] attention sinks (gpt-oss), added as the splits merge
) -> jax.Array:
    """Attention of a ragged batch over the paged pool (backends.AttentionFn); pure, returns a new array.

    Raises ValueError for shapes, dtypes or sizes the kernel cannot handle.
    """
    _validate(q, kv_pool, md, num_kv_splits, interpret)
    if max_slots < 2:
        raise ValueError(f"max_slots must be >= 2, got {max_slots}")
    # A Python soft cap is known at trace time: none skips the tanh, a value is baked in.
    static_cap = float(soft_cap) if isinstance(soft_cap, (int, float)) else None
    return _attention(q, kv_pool, layer, md, sliding_window, jnp.asarray(soft_cap, jnp.float32).reshape(1), sinks,
                      sm_scale=sm_scale, interpret=interpret, num_kv_splits=num_kv_splits, max_slots=max_slots,
                      static_cap=static_cap)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "num_kv_splits", "max_slots", "static_cap"))
def _attention(q, kv_pool, layer, md, sliding_window, cap, sinks, *, sm_scale, interpret, num_kv_splits, max_slots,
               static_cap):
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = kv_pool.shape[3]
    num_tiles = num_query_tiles(num_tokens, md.kv_lens.shape[0], kernel_q_tile(md.q_tile, num_heads // kv_heads, ROWS))
    plan = _plan(q, kv_pool, md, num_tiles, num_kv_splits, max_slots)
    # HBM holds a tile's real rows (rounded up to 8); SMEM pads them to the 64 a wgmma takes
    tiles = tile_queries(q, md, layer, sliding_window, kv_heads=kv_heads, max_rows=ROWS, rows=plan.rows)
    # A step starts at any page before max_blocks: the padded columns keep its table reads in bounds.
    tables = jnp.pad(md.block_tables.astype(jnp.int32), ((0, 0), (0, plan.copies - 1)))

    split_output = plan.num_splits > 1 or sinks is not None
    if split_output:
        out_type = [jax.ShapeDtypeStruct((plan.num_splits, num_tiles, kv_heads, plan.rows, head_dim), jnp.float32),
                    jax.ShapeDtypeStruct((plan.num_splits, num_tiles, kv_heads, plan.rows), jnp.float32),
                    jax.ShapeDtypeStruct((plan.num_splits, num_tiles, kv_heads, plan.rows), jnp.float32)]
    else:
        out_type = [jax.ShapeDtypeStruct((num_tiles, kv_heads, plan.rows, head_dim), q.dtype)]
    program = functools.partial(
        _program, plan=plan, group=num_heads // kv_heads, max_blocks=md.block_tables.shape[1], sm_scale=sm_scale,
        static_cap=static_cap, split_output=split_output, interpret=interpret)
    result = plgpu.kernel(
        program, out_type=out_type,
        grid=(num_tiles, kv_heads, plan.num_splits), grid_names=("tile", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(tiles.info, tables, cap, tiles.q_tiles, kv_pool)
    sink = None if sinks is None else sink_rows(sinks, kv_heads, plan.rows)
    out = merge_splits(*result, sink) if split_output else result[0]
    return untile(out, tiles, num_heads, q.dtype)


def _program(info_ref, tables_ref, cap_ref, q_ref, kv_ref, *out_refs, plan: _Plan, group, max_blocks, sm_scale,
             static_cap, split_output, interpret):
    tile, head, split = lax.axis_index("tile"), lax.axis_index("head"), lax.axis_index("split")
    seq, kv_len, first_pos = info_ref[tile, SEQ], info_ref[tile, KV_LEN], info_ref[tile, FIRST_POS]
    num_queries, layer, window = info_ref[tile, NUM_QUERIES], info_ref[tile, LAYER], info_ref[tile, WINDOW]
    dtype, head_dim = q_ref.dtype, q_ref.shape[-1]
    block_size = kv_ref.shape[4]
    chunk, slots, rows = plan.chunk, plan.slots, pl.ds(0, plan.rows)
    first, end = visible_pages(kv_len, first_pos, num_queries, window, block_size=block_size, max_blocks=max_blocks)
    page_begin, page_stop = split_pages(first, end, split, plan.num_splits)
    first_key = page_begin * block_size
    num_steps = ((page_stop - page_begin) * block_size + KEYS - 1) // KEYS
    # A split starts anywhere, so its last step may reach past its pages (into the next split's,
    # or the table's padding): those keys are masked, and their copies read the null block.
    key_stop = jnp.minimum(kv_len, page_stop * block_size)
    fp8 = fp8_type(kv_ref.dtype)

    def walk(q_smem, k_smem, v_smem, staged, q_bar, k_bar, v_bar, *p_smem):
        # the tile's real rows; the rest of the 64 hold whatever SMEM held: their rows are masked
        plgpu.copy_gmem_to_smem(q_ref.at[tile, head], q_smem.at[rows], q_bar)

        def issue(step):
            slot = lax.rem(step, slots)
            for i in range(plan.copies):
                key = first_key + step * KEYS + i * chunk
                index = key // block_size
                page = jnp.where(index < page_stop, tables_ref[seq, index], 0)
                part = pl.ds(key % block_size, chunk) if chunk < block_size else slice(None)
                dst = pl.ds(i * chunk, chunk)
                plgpu.copy_gmem_to_smem(kv_ref.at[layer, 0, page, head, part], k_smem.at[slot, dst], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(kv_ref.at[layer, 1, page, head, part], v_smem.at[slot, dst], v_bar.at[slot])

        for step in range(slots - 1):
            pl.when(step < num_steps)(functools.partial(issue, step))
        plgpu.barrier_wait(q_bar)

        def widened(src, which):
            """An fp8 step widened to q's dtype in SMEM (wgmma reads its B operand from SMEM)."""
            if fp8 is None:
                return src
            values = lax.bitcast_convert_type(src[...], fp8)
            # Hopper widens fp8 only to f16 in one instruction; bf16 goes through f32.
            staged[which][...] = (values if dtype == jnp.float16 else values.astype(jnp.float32)).astype(dtype)
            plgpu.commit_smem()
            return staged[which]

        def body(step, carry):
            acc, m, l = carry

            @pl.when(step + slots - 1 < num_steps)
            def _prefetch():                       # into the slot the previous step finished with
                issue(step + slots - 1)

            slot = lax.rem(step, slots)
            plgpu.barrier_wait(k_bar.at[slot])
            k = widened(k_smem.at[slot], 0)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k.T)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((ROWS, KEYS), jnp.float32)) * sm_scale
            if static_cap is None:
                cap = cap_ref[0]
                s = jnp.where(cap > 0, cap * jnp.tanh(s / jnp.where(cap > 0, cap, 1.0)), s)
            elif static_cap > 0:
                s = static_cap * jnp.tanh(s * (1.0 / static_cap))
            iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, (ROWS, KEYS), layout=plgpu.Layout.WGMMA)
            query = lax.div(iota(0), group)        # row r holds query r // group, head r % group
            q_pos = first_pos + query
            k_pos = first_key + step * KEYS + iota(1)
            mask = (query < num_queries) & (k_pos < key_stop) & (k_pos <= q_pos)
            mask &= (window <= 0) | (q_pos - k_pos < window)
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if interpret:
                # GPU interpret mode takes both wgmma operands from SMEM, and does not interpret
                # run_state: P goes through SMEM into a fresh accumulator
                p_smem[0][...] = p.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_wait(v_bar.at[slot])
                v = widened(v_smem.at[slot], 1)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem[0], v)
                    return acc_ref[...]
                return acc + pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32)), m_new, l
            # on the GPU P stays in registers (wgmma's A operand) and accumulates in place
            p = p.astype(dtype)
            plgpu.barrier_wait(v_bar.at[slot])
            v = widened(v_smem.at[slot], 1)

            def pv_in_place(acc_ref):
                plgpu.wgmma(acc_ref, p, v)
            return pl.run_state(pv_in_place)(plgpu.ACC.init(acc)), m_new, l

        acc = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((ROWS,), _MASKED, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        return lax.fori_loop(0, num_steps, body, (acc, m, l))

    # fp8 bytes are only copied in and read back (widened), never a wgmma operand: no swizzle.
    kv_smem = plgpu.SMEM((slots, KEYS, head_dim), kv_ref.dtype,
                         transforms=() if fp8 is not None else _swizzled(kv_ref.dtype))
    staged = [plgpu.SMEM((KEYS, head_dim), dtype, transforms=_swizzled(dtype))] * 2 if fp8 is not None else []
    p_smem = [plgpu.SMEM((ROWS, KEYS), dtype, transforms=_swizzled(dtype))] if interpret else []
    acc, m, l = pl.run_scoped(
        walk,
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=_swizzled(dtype)), kv_smem, kv_smem, staged,
        plgpu.Barrier(), plgpu.Barrier(num_arrivals=plan.copies, num_barriers=slots),
        plgpu.Barrier(num_arrivals=plan.copies, num_barriers=slots), *p_smem)

    # The walk's SMEM is free again: the output is staged there and its real rows copied out by TMA.
    if split_output:
        acc_out, m_out, l_out = out_refs

        def store_partial(acc_smem, m_smem, l_smem):
            acc_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(acc_smem.at[rows], acc_out.at[split, tile, head])
            plgpu.copy_smem_to_gmem(m_smem.at[rows], m_out.at[split, tile, head])
            plgpu.copy_smem_to_gmem(l_smem.at[rows], l_out.at[split, tile, head])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(store_partial, plgpu.SMEM((ROWS, head_dim), jnp.float32, transforms=_swizzled(jnp.float32)),
                      plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32))
    else:
        (out_ref,) = out_refs

        def store(o_smem):
            o_smem[...] = (acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[rows], out_ref.at[tile, head])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(store, plgpu.SMEM((ROWS, head_dim), dtype, transforms=_swizzled(dtype)))
