"""Ragged paged attention as a Triton kernel called through jax-triton (NVIDIA GPUs).

Same contract as `reference.py`. One program owns one (query tile, row block, kv head, kv split):

    grid = (num_tiles * row_blocks, kv_heads, num_splits)
    rows of a program = (query row, head of the GQA group) pairs, flattened: r -> (r // group, r % group)

so the K/V pages of a kv head are read once for all query heads that share them. A program
walks only the keys its rows can see (up to its last query's position, from its first query's
window start), in chunks of `chunk_blocks` pages gathered through the block table. Those chunks
are divided evenly among `num_splits` programs (split-K: a long decode context keeps the GPU
busy when there are few sequences); each writes an unnormalised (acc, max, sum) and a small jnp
reduction combines them. Dots take the pool's dtype (q is cast to it) and accumulate in fp32; an fp8
pool's pages are cast to q's dtype instead (`compute_dtype`): its scales are applied outside, see
`jaxpaged.kernels.layout.scaled_attention`.

`kernel_call_args` and `combine_splits` are public so that tests replay the very same launch on
CPU (a numpy emulation of the tiling, and this kernel under Triton's interpreter) besides
compiling it for sm_80 and sm_90.
"""

import dataclasses
import functools
import inspect
import math
import numbers

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from jaxpaged.kernels.layout import fp8_type, is_fp8
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import tile_layout, num_query_tiles, validate_inputs
from jaxpaged.kernels.tiling import sink_rows

_MASKED = tl.constexpr(-1e30)
_TARGET_PROGRAMS = 264  # two waves of an H100/H200's 132 SMs: below that, split the KV walk
_MAX_SPLITS = 16
_MIN_DOT = 16           # tl.dot needs every dimension >= 16
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_FP8_CODES = {None: 0, jnp.dtype(jnp.float8_e4m3fn): 1, jnp.dtype(jnp.float8_e5m2): 2}   # the kernel's KV_FP8
def compute_dtype(q_dtype, pool_dtype):
    """The dots' input dtype: the pool's, or q's when the pool is fp8."""
    return q_dtype if is_fp8(pool_dtype) else pool_dtype


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class TritonLaunch:
    """Static tiling of one call, shared by the kernel launch and the numpy emulation."""

    num_tiles: int
    num_heads: int
    kv_heads: int
    group: int
    q_tile: int
    rows: int          # rows per program, a power of two >= 16
    row_blocks: int    # programs per query tile along the rows
    head_dim: int
    head_dim_pad: int
    block_size: int
    num_blocks: int    # pages per (layer, K|V) plane of the pool
    max_blocks: int
    chunk_blocks: int  # pages per step of the KV walk
    num_splits: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.num_tiles * self.row_blocks, self.kv_heads, self.num_splits)

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_blocks * self.block_size


def plan_launch(q_shape, kv_pool_shape, block_tables_shape, q_tile: int, kv_chunk_blocks: int,
                dtype=jnp.bfloat16) -> TritonLaunch:
    """The grid and tile sizes for these static shapes; `dtype` is the pool's (the dots' inputs)."""
    num_tokens, num_heads, head_dim = q_shape
    _, _, num_blocks, kv_heads, block_size, _ = kv_pool_shape
    num_seqs, max_blocks = block_tables_shape
    group = num_heads // kv_heads
    # Tile sizes ptxas keeps in registers without spilling (measured for sm_80 and sm_90 at head_dim
    # 64 and 128): an fp32 dot runs on FMAs and needs far smaller tiles than a 16-bit one.
    wide = jnp.dtype(dtype) == jnp.float32
    head_dim_pad = _pow2_at_least(max(_MIN_DOT, head_dim))
    rows = min(32 if wide else 128, _pow2_at_least(max(_MIN_DOT, q_tile * group)))
    max_keys = max(_MIN_DOT, min(128, (2048 if wide else 8192) // head_dim_pad))
    num_tiles = num_query_tiles(num_tokens, num_seqs, q_tile)
    row_blocks = -(-q_tile * group // rows)
    chunk_blocks = min(1 << (kv_chunk_blocks.bit_length() - 1), _pow2_at_least(max_blocks))
    chunk_blocks = max(min(chunk_blocks, max_keys // block_size), -(-_MIN_DOT // block_size), 1)
    programs = num_tiles * row_blocks * kv_heads
    num_splits = max(1, min(_MAX_SPLITS, -(-max_blocks // chunk_blocks), _TARGET_PROGRAMS // programs))
    return TritonLaunch(num_tiles=num_tiles, num_heads=num_heads, kv_heads=kv_heads, group=group, q_tile=q_tile,
                        rows=rows, row_blocks=row_blocks, head_dim=head_dim,
                        head_dim_pad=head_dim_pad, block_size=block_size,
                        num_blocks=num_blocks, max_blocks=max_blocks, chunk_blocks=chunk_blocks,
                        num_splits=num_splits)


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1) saturates cleanly to +-1 when e^2x overflows or vanishes.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
        q_ptr, pool_ptr, layer_ptr, window_ptr, cap_ptr, kv_lens_ptr, block_tables_ptr, cu_q_lens_ptr,
        tile_seq_ptr, tile_first_row_ptr, tile_rows_ptr,        # inputs
        acc_ptr, m_ptr, l_ptr,                                  # outputs, one slot per program
        NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, Q_TILE: tl.constexpr,
        ROWS: tl.constexpr, ROW_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
        CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr, SM_SCALE: tl.constexpr, PRECISION: tl.constexpr,
        KV_FP8: tl.constexpr):
    tile = tl.program_id(0) // ROW_BLOCKS
    row_block = tl.program_id(0) % ROW_BLOCKS
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    first_row = tl.load(tile_first_row_ptr + tile)
    num_rows = tl.load(tile_rows_ptr + tile)                    # 0 for a padding tile
    kv_len = tl.load(kv_lens_ptr + seq)
    q_start = tl.load(cu_q_lens_ptr + seq)
    pos_offset = kv_len - (tl.load(cu_q_lens_ptr + seq + 1) - q_start) + first_row
    window = tl.load(window_ptr)
    cap = tl.load(cap_ptr)

    r = row_block * ROWS + tl.arange(0, ROWS)
    row = r // GROUP
    row_ok = (r < Q_TILE * GROUP) & (row < num_rows)
    q_pos = pos_offset + row
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_off = ((q_start + first_row + row) * NUM_HEADS + kv_head * GROUP + r % GROUP) * HEAD_DIM
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if not KV_FP8:
        q = q.to(pool_ptr.dtype.element_ty)

    # Keys this program can see: up to its last query (causal), from its first query's window.
    start_row = row_block * ROWS // GROUP
    end_row = tl.minimum(tl.cdiv(tl.minimum((row_block + 1) * ROWS, Q_TILE * GROUP), GROUP), num_rows)
    hi = pos_offset + end_row
    lo = tl.where(window > 0, tl.maximum(pos_offset + start_row - window + 1, 0), 0)
    chunk_lo = lo // CHUNK
    # Padding tiles and row blocks past a short tile's last row walk nothing.
    chunk_hi = tl.where((end_row > start_row) & (hi > lo), tl.cdiv(hi, CHUNK), chunk_lo)
    per_split = tl.cdiv(chunk_hi - chunk_lo, NUM_SPLITS)
    chunk_begin = chunk_lo + split * per_split
    chunk_end = tl.minimum(chunk_begin + per_split, chunk_hi)

    # int64: a pool filling a 141 GB GPU has more than 2**31 elements.
    PLANE = NUM_BLOCKS * BLOCK_SIZE * KV_HEADS * HEAD_DIM
    k_base = tl.load(layer_ptr).to(tl.int64) * 2 * PLANE
    n = tl.arange(0, CHUNK)
    m_i = tl.full([ROWS], _MASKED, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    for c in range(chunk_begin, chunk_end):
        k_pos = c * CHUNK + n
        k_ok = (k_pos < kv_len) & (k_pos // BLOCK_SIZE < MAX_BLOCKS)
        block_id = tl.load(block_tables_ptr + seq * MAX_BLOCKS + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        page = block_id.to(tl.int64) * KV_HEADS + kv_head     # this head's [BLOCK_SIZE, HEAD_DIM] tile
        kv_off = k_base + (page * BLOCK_SIZE + k_pos % BLOCK_SIZE) * HEAD_DIM
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(pool_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pool_ptr + PLANE + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8 == 1:   # the pool holds fp8 bytes (layout.kv_storage_dtype)
            k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)
            v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        elif KV_FP8 == 2:
            k = k.to(tl.float8e5, bitcast=True).to(q.dtype)
            v = v.to(tl.float8e5, bitcast=True).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SM_SCALE
        safe_cap = tl.where(cap > 0, cap, 1.0)
        s = tl.where(cap > 0, safe_cap * _tanh(s / safe_cap), s)
        mask = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        mask &= (window <= 0) | (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(mask, s, _MASKED)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.where(mask, tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_row = ((tile * KV_HEADS + kv_head) * NUM_SPLITS + split) * (ROW_BLOCKS * ROWS) + r
    tl.store(acc_ptr + out_row[:, None] * HEAD_DIM_PAD + d[None, :], acc)
    tl.store(m_ptr + out_row, m_i)
    tl.store(l_ptr + out_row, l_i)


def _validate(q, kv_pool, layer, md, sliding_window, soft_cap, sm_scale, kv_chunk_blocks) -> None:
    validate_inputs(q, kv_pool, md)
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if kv_pool.dtype not in _DTYPES and not is_fp8(kv_pool.dtype):
        raise ValueError("kv_pool dtype must be float32, bfloat16, float16, or an fp8 pool's bytes (uint8: e4m3, "
                         f"int8: e5m2; see layout.kv_storage_dtype), got {kv_pool.dtype}")
    for name, x in (("layer", layer), ("sliding_window", sliding_window), ("soft_cap", soft_cap)):
        if jnp.ndim(x) != 0:
            raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(x)}")
    if q.shape[0] < 1 or md.kv_lens.shape[0] < 1 or md.block_tables.shape[1] < 1:
        raise ValueError(f"q needs >= 1 token and md >= 1 sequence and block column, got q {q.shape}, "
                         f"block_tables {md.block_tables.shape}")
    block_size = kv_pool.shape[4]
    if block_size & (block_size - 1):
        raise ValueError(f"kv_pool block_size (axis 4) must be a power of two, got {block_size}")
    if not isinstance(kv_chunk_blocks, int) or kv_chunk_blocks < 1:
        raise ValueError(f"kv_chunk_blocks must be an int >= 1, got {kv_chunk_blocks!r}")
    if not isinstance(sm_scale, numbers.Real) or not 0 < sm_scale < math.inf:
        raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale!r}")


def _target_compute_capability() -> int | None:
    """None lets jax-triton ask the local GPU; lowering on a host without one (AOT, CPU tests)
    takes the GPU named by the abstract mesh's device, e.g. "NVIDIA H200" -> 90."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is None or abstract.platform not in ("gpu", "cuda") or jax.devices()[0].platform == "gpu":
        return None
    try:  # jax's own table of GPU kinds, as jax-triton uses it: jax._src.gpu_info from JAX 0.12
        from jax._src import gpu_info
    except ImportError:  # JAX 0.11
        from jax._src.pallas.triton import gpu_info
    return gpu_info.get_gpu_info().compute_capability


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_chunk_blocks"))
def ragged_paged_attention_triton(
    q: jax.Array, kv_pool: jax.Array, layer: jax.Array, md: AttentionMetadata,
    sliding_window: jax.Array | int = 0, soft_cap: float | jax.Array = 0.0, *, sm_scale: float,
    kv_chunk_blocks: int = 8,  # pages per step of the KV walk (a power of two; capped, see plan_launch)
    sinks: jax.Array | None = None,   # [num_heads] attention sinks (gpt-oss), added as the splits merge
) -> jax.Array:
    """Attention of a ragged batch over the paged pool (backends.AttentionFn) as a Triton kernel."""
    import jax_triton  # here, not at the top: the tiling and its CPU tests need no cuda12 extra

    launch, operands, out_type, meta, tokens = kernel_call_args(q, kv_pool, layer, md, sliding_window, soft_cap,
                                                              sm_scale=sm_scale, kv_chunk_blocks=kv_chunk_blocks)
    # jax-triton 0.4 names the outputs `out_type`; 0.3 (the one that pairs with triton 3.6) `out_shape`
    out_keyword = "out_type" if "out_type" in inspect.signature(jax_triton.triton_call).parameters else "out_shape"
    acc, m, l = jax_triton.triton_call(
        *operands, kernel=_paged_attention_kernel, **{out_keyword: out_type}, grid=launch.grid,
        name="ragged_paged_attention", num_warps=8 if launch.rows >= 128 else 4, num_stages=2,
        compute_capability=_target_compute_capability(), **meta)
    return combine_splits(acc, m, l, launch, tokens, q.dtype, sinks)


def kernel_call_args(q, kv_pool, layer, md: AttentionMetadata, sliding_window=0, soft_cap=0.0, *,
                     sm_scale: float, kv_chunk_blocks: int = 8):
    """Validates, then returns (launch, operands, out_type, constexprs, token gather) of the kernel
    call: everything triton_call is given, so a replay on CPU launches exactly the same thing."""
    _validate(q, kv_pool, layer, md, sliding_window, soft_cap, sm_scale, kv_chunk_blocks)
    dots = compute_dtype(q.dtype, kv_pool.dtype)
    launch = plan_launch(q.shape, kv_pool.shape, md.block_tables.shape, md.q_tile, kv_chunk_blocks, dots)
    tiles, tokens = _tile_operands(md, q.shape[0])
    slots = launch.num_tiles * launch.kv_heads * launch.num_splits * launch.row_blocks * launch.rows
    out_type = (jax.ShapeDtypeStruct((slots, launch.head_dim_pad), jnp.float32),
                jax.ShapeDtypeStruct((slots,), jnp.float32), jax.ShapeDtypeStruct((slots,), jnp.float32))
    scalars = (jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.reshape(sliding_window, (1,)).astype(jnp.int32),
               jnp.reshape(soft_cap, (1,)).astype(jnp.float32))
    ints = tuple(x.astype(jnp.int32) for x in (md.kv_lens, md.block_tables, md.cu_q_lens))
    meta = dict(NUM_HEADS=launch.num_heads, KV_HEADS=launch.kv_heads, GROUP=launch.group, Q_TILE=launch.q_tile,
                ROWS=launch.rows, ROW_BLOCKS=launch.row_blocks, HEAD_DIM=launch.head_dim,
                HEAD_DIM_PAD=launch.head_dim_pad, BLOCK_SIZE=launch.block_size, NUM_BLOCKS=launch.num_blocks,
                MAX_BLOCKS=launch.max_blocks, CHUNK=launch.chunk_tokens, NUM_SPLITS=launch.num_splits,
                SM_SCALE=float(sm_scale), PRECISION="ieee" if dots == jnp.float32 else "tf32",
                KV_FP8=_FP8_CODES[fp8_type(kv_pool.dtype)])
    return launch, (q, kv_pool, *scalars, *ints, *tiles), out_type, meta, tokens


@functools.partial(jax.jit, static_argnums=1)  # one compile, not one per op, when called eagerly
def _tile_operands(md: AttentionMetadata, num_tokens: int):
    """Per tile: owning sequence, first query row, live rows (0 for padding); per token: tile and row."""
    q_lens, tile_seq, tile_valid, tile_first_row, token_tile, token_row = tile_layout(md, num_tokens)
    tile_rows = jnp.where(tile_valid, jnp.clip(q_lens[tile_seq] - tile_first_row, 0, md.q_tile), 0)
    return tuple(x.astype(jnp.int32) for x in (tile_seq, tile_first_row, tile_rows)), (token_tile, token_row)


@functools.partial(jax.jit, static_argnames=("launch", "dtype"))
def combine_splits(acc, m, l, launch: TritonLaunch, tokens, dtype, sinks=None) -> jax.Array:
    """Merges the kernel's per-split (acc, max, sum) and gathers rows back to [num_tokens, num_heads, head_dim];
    `sinks` [num_heads] (gpt-oss): each head's sink joins its rows' sums as a key of value 0."""
    n, kv_heads, live = launch.num_tiles, launch.kv_heads, launch.q_tile * launch.group
    shape = (n, kv_heads, launch.num_splits, launch.row_blocks * launch.rows)
    acc = acc.reshape(*shape, -1)[..., :live, :launch.head_dim]
    m, l = m.reshape(shape)[..., :live], l.reshape(shape)[..., :live]
    m_all = m.max(axis=2, keepdims=True)
    if sinks is not None:
        sink = sink_rows(sinks, kv_heads, live)[:, None, :]   # [kv_heads, 1 split, rows]
        m_all = jnp.maximum(m_all, sink)
    weight = jnp.exp(m - m_all)  # an empty split has m = -1e30: weight 0
    l = (weight * l).sum(axis=2)
    if sinks is not None:
        l = l + jnp.exp(sink - m_all)[:, :, 0]
    out = (weight[..., None] * acc).sum(axis=2) / jnp.where(l > 0, l, 1.0)[..., None]
    out = out.reshape(n, kv_heads, launch.q_tile, launch.group, launch.head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(n, launch.q_tile, launch.num_heads, launch.head_dim)
    return out[tokens[0], tokens[1]].astype(dtype)
