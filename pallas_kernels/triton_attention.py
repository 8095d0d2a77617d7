"""Ragged paged attention as a Triton kernel called through jax-triton (NVIDIA GPUs).

Same contract as `reference.py`. One program owns one (query tile, row block, kv head, kv split):

    grid = (num_tiles * row_blocks, kv_heads, num_splits)
    rows of a program = (query row, head of the GQA group) pairs, flattened: r -> (r // group, r % group)

so the K/V pages of a kv head are read once for all query heads that share them. A program
walks only the keys its rows can see (up to its last query's position, from its first query's
window start), in chunks of `chunk_blocks` pages gathered through the block table. Those chunks
are divided evenly among `num_splits` programs (split-K: a long decode context keeps the GPU
busy when there are few sequences); each writes an unnormalised (acc, max, sum) and a small jnp
reduction combines them. `emulate_triton_attention` replays exactly this tiling in numpy so
the algorithm is tested on CPU; the Triton code itself is checked there by compiling it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jax_triton
import numpy as np
import triton
import triton.language as tl

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import _tile_layout, num_query_tiles, validate_inputs

_MASKED = tl.constexpr(-1e30)
_TARGET_PROGRAMS = 264  # two waves of an H100/H200's 132 SMs: below that, split the KV walk
_MAX_SPLITS = 16
_MAX_ROWS = 128         # rows per program: a [128, 128] fp32 accumulator is what registers hold
_MIN_DOT = 16           # tl.dot needs every dimension >= 16
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


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


def plan_launch(q_shape, kv_pool_shape, block_tables_shape, q_tile: int, kv_chunk_blocks: int) -> TritonLaunch:
    num_tokens, num_heads, head_dim = q_shape
    _, _, num_blocks, block_size, kv_heads, _ = kv_pool_shape
    num_seqs, max_blocks = block_tables_shape
    group = num_heads // kv_heads
    rows = min(_MAX_ROWS, _pow2_at_least(max(_MIN_DOT, q_tile * group)))
    num_tiles = num_query_tiles(num_tokens, num_seqs, q_tile)
    row_blocks = -(-q_tile * group // rows)
    # A power of two of pages, at most 128 keys (two K/V stages then fit an A100's shared
    # memory at head_dim 128) and at least the 16 keys tl.dot needs.
    chunk_blocks = 1 << (kv_chunk_blocks.bit_length() - 1)
    chunk_blocks = min(chunk_blocks, _pow2_at_least(max_blocks), max(1, _MAX_ROWS // block_size))
    chunk_blocks = max(chunk_blocks, -(-_MIN_DOT // block_size))
    programs = num_tiles * row_blocks * kv_heads
    num_splits = max(1, min(_MAX_SPLITS, -(-max_blocks // chunk_blocks), _TARGET_PROGRAMS // programs))
    return TritonLaunch(num_tiles=num_tiles, num_heads=num_heads, kv_heads=kv_heads, group=group, q_tile=q_tile,
                        rows=rows, row_blocks=row_blocks, head_dim=head_dim,
                        head_dim_pad=_pow2_at_least(max(_MIN_DOT, head_dim)), block_size=block_size,
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
        CHUNK_BLOCKS: tl.constexpr, NUM_SPLITS: tl.constexpr, SM_SCALE: tl.constexpr, PRECISION: tl.constexpr):
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
    q = q.to(pool_ptr.dtype.element_ty)

    # Keys this program can see: up to its last query (causal), from its first query's window.
    CHUNK: tl.constexpr = CHUNK_BLOCKS * BLOCK_SIZE
    start_row = row_block * ROWS // GROUP
    end_row = tl.minimum(tl.cdiv(tl.minimum((row_block + 1) * ROWS, Q_TILE * GROUP), GROUP), num_rows)
    hi = pos_offset + end_row
    lo = tl.where(window > 0, tl.maximum(pos_offset + start_row - window + 1, 0), 0)
    chunk_lo = lo // CHUNK
    chunk_hi = tl.where(hi > lo, tl.cdiv(hi, CHUNK), chunk_lo)
    per_split = tl.cdiv(chunk_hi - chunk_lo, NUM_SPLITS)
    chunk_begin = chunk_lo + split * per_split
    chunk_end = tl.minimum(chunk_begin + per_split, chunk_hi)

    # int64: a pool filling a 141 GB GPU has more than 2**31 elements.
    PLANE: tl.constexpr = NUM_BLOCKS * BLOCK_SIZE * KV_HEADS * HEAD_DIM
    k_base = tl.load(layer_ptr).to(tl.int64) * 2 * PLANE
    n = tl.arange(0, CHUNK)
    m_i = tl.full([ROWS], _MASKED, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    for c in range(chunk_begin, chunk_end):
        k_pos = c * CHUNK + n
        k_ok = (k_pos < kv_len) & (k_pos // BLOCK_SIZE < MAX_BLOCKS)
        block_id = tl.load(block_tables_ptr + seq * MAX_BLOCKS + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot = block_id.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        kv_off = k_base + (slot * KV_HEADS + kv_head) * HEAD_DIM
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(pool_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pool_ptr + PLANE + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
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
    for name, x in (("q", q), ("kv_pool", kv_pool)):
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    for name, x in (("layer", layer), ("sliding_window", sliding_window), ("soft_cap", soft_cap)):
        if jnp.ndim(x) != 0:
            raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(x)}")
    if q.shape[0] < 1 or md.kv_lens.shape[0] < 1 or md.block_tables.shape[1] < 1:
        raise ValueError(f"q needs >= 1 token and md >= 1 sequence and block column, got q {q.shape}, "
                         f"block_tables {md.block_tables.shape}")
    block_size = kv_pool.shape[3]
    if block_size & (block_size - 1):
        raise ValueError(f"kv_pool block_size (axis 3) must be a power of two, got {block_size}")
    if not isinstance(kv_chunk_blocks, int) or kv_chunk_blocks < 1:
        raise ValueError(f"kv_chunk_blocks must be an int >= 1, got {kv_chunk_blocks!r}")
    if not isinstance(sm_scale, (int, float)) or not 0 < sm_scale < float("inf"):
        raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale!r}")


def _tile_arrays(md: AttentionMetadata, num_tokens: int):
    """Per tile (owning sequence, first query row, live rows); per token (tile, row in tile)."""
    q_lens, tile_seq, tile_valid, tile_first_row, token_tile, token_row = _tile_layout(md, num_tokens)
    tile_rows = jnp.where(tile_valid, jnp.clip(q_lens[tile_seq] - tile_first_row, 0, md.q_tile), 0)
    tiles = tuple(x.astype(jnp.int32) for x in (tile_seq, tile_first_row, tile_rows))
    return tiles, (token_tile, token_row)


def _combine(acc, m, l, launch: TritonLaunch, token_tile, token_row, dtype) -> jax.Array:
    """Merge the splits' partial softmaxes: acc [N, kv_heads, splits, rows, >=D], m and l [N, kv_heads, splits, rows]."""
    n, kv_heads, live = launch.num_tiles, launch.kv_heads, launch.q_tile * launch.group
    acc, m, l = acc[:, :, :, :live, :launch.head_dim], m[..., :live], l[..., :live]
    weight = jnp.exp(m - m.max(axis=2, keepdims=True))  # an empty split has m = -1e30: weight 0
    l = (weight * l).sum(axis=2)
    out = (weight[..., None] * acc).sum(axis=2) / jnp.where(l > 0, l, 1.0)[..., None]
    out = out.reshape(n, kv_heads, launch.q_tile, launch.group, launch.head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(n, launch.q_tile, launch.num_heads, launch.head_dim)[token_tile, token_row].astype(dtype)


def _target_compute_capability() -> int | None:
    """None lets jax-triton ask the local GPU; lowering on a host without one (AOT, CPU tests)
    takes the GPU named by the abstract mesh's device, e.g. "NVIDIA H200" -> 90."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is None or abstract.platform not in ("gpu", "cuda") or jax.devices()[0].platform == "gpu":
        return None
    from jax._src.pallas.triton import gpu_info  # jax's own table of GPU kinds, as jax-triton uses it
    return gpu_info.get_gpu_info().compute_capability


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_chunk_blocks"))
def ragged_paged_attention_triton(
    q: jax.Array,             # [num_tokens, num_heads, head_dim]
    kv_pool: jax.Array,       # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    layer: jax.Array,         # i32[] which layer of the pool to read
    md: AttentionMetadata,
    sliding_window: jax.Array | int = 0,  # i32[]; 0 = no window, else keys with q_pos - k_pos < window
    soft_cap: float | jax.Array = 0.0,    # 0 = off, else logits -> cap * tanh(logits / cap)
    *,
    sm_scale: float,
    kv_chunk_blocks: int = 8,  # pages per step of the KV walk; rounded to a power of two, <= 128 keys
) -> jax.Array:               # [num_tokens, num_heads, head_dim], dtype of q
    _validate(q, kv_pool, layer, md, sliding_window, soft_cap, sm_scale, kv_chunk_blocks)
    launch = plan_launch(q.shape, kv_pool.shape, md.block_tables.shape, md.q_tile, kv_chunk_blocks)
    tiles, tokens = _tile_arrays(md, q.shape[0])
    n, kv_heads, splits, rows = launch.num_tiles, launch.kv_heads, launch.num_splits, launch.row_blocks * launch.rows
    out_type = (jax.ShapeDtypeStruct((n * kv_heads * splits * rows, launch.head_dim_pad), jnp.float32),
                jax.ShapeDtypeStruct((n * kv_heads * splits * rows,), jnp.float32),
                jax.ShapeDtypeStruct((n * kv_heads * splits * rows,), jnp.float32))
    acc, m, l = jax_triton.triton_call(
        q, kv_pool, jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.reshape(sliding_window, (1,)).astype(jnp.int32),
        jnp.reshape(soft_cap, (1,)).astype(jnp.float32), md.kv_lens.astype(jnp.int32),
        md.block_tables.astype(jnp.int32), md.cu_q_lens.astype(jnp.int32), *tiles,
        kernel=_paged_attention_kernel, out_type=out_type, grid=launch.grid, name="ragged_paged_attention",
        num_warps=8 if launch.rows >= 128 else 4, num_stages=2, compute_capability=_target_compute_capability(),
        NUM_HEADS=launch.num_heads, KV_HEADS=kv_heads, GROUP=launch.group, Q_TILE=launch.q_tile,
        ROWS=launch.rows, ROW_BLOCKS=launch.row_blocks, HEAD_DIM=launch.head_dim,
        HEAD_DIM_PAD=launch.head_dim_pad, BLOCK_SIZE=launch.block_size, NUM_BLOCKS=launch.num_blocks,
        MAX_BLOCKS=launch.max_blocks, CHUNK_BLOCKS=launch.chunk_blocks, NUM_SPLITS=splits,
        SM_SCALE=float(sm_scale), PRECISION="ieee" if kv_pool.dtype == jnp.float32 else "tf32")
    shape = (n, kv_heads, splits, rows)
    return _combine(acc.reshape(*shape, -1), m.reshape(shape), l.reshape(shape), launch, *tokens, q.dtype)


def emulate_triton_attention(q, kv_pool, layer, md: AttentionMetadata, sliding_window=0, soft_cap=0.0, *,
                             sm_scale: float, kv_chunk_blocks: int = 8) -> jax.Array:
    """The kernel replayed in numpy, program by program: same grid, key ranges, masks, dot input
    dtypes and split-K combine. Concrete inputs only; slow, for testing the tiling on CPU."""
    _validate(q, kv_pool, layer, md, sliding_window, soft_cap, sm_scale, kv_chunk_blocks)
    launch = plan_launch(q.shape, kv_pool.shape, md.block_tables.shape, md.q_tile, kv_chunk_blocks)
    tiles, tokens = _tile_arrays(md, q.shape[0])
    tile_seq, tile_first_row, tile_rows = (np.asarray(x) for x in tiles)
    kv_lens, cu_q_lens, tables = (np.asarray(x) for x in (md.kv_lens, md.cu_q_lens, md.block_tables))
    pages = np.asarray(kv_pool)[int(layer)]                    # [2, num_blocks, block_size, kv_heads, head_dim]
    dot_dtype = pages.dtype
    queries = np.asarray(q).astype(dot_dtype).astype(np.float32)
    window, cap = int(sliding_window), float(soft_cap)
    group, rows, chunk = launch.group, launch.rows, launch.chunk_tokens
    n, kv_heads, splits = launch.num_tiles, launch.kv_heads, launch.num_splits
    acc = np.zeros((n, kv_heads, splits, launch.row_blocks * rows, launch.head_dim), np.float32)
    m_out = np.full(acc.shape[:-1], float(_MASKED.value), np.float32)
    l_out = np.zeros(acc.shape[:-1], np.float32)
    for program in np.ndindex(*launch.grid):
        (tile, row_block), kv_head, split = divmod(program[0], launch.row_blocks), program[1], program[2]
        seq, first_row, num_rows = tile_seq[tile], tile_first_row[tile], tile_rows[tile]
        kv_len, q_start = kv_lens[seq], cu_q_lens[seq]
        pos_offset = kv_len - (cu_q_lens[seq + 1] - q_start) + first_row
        r = row_block * rows + np.arange(rows)
        row = r // group
        row_ok = (r < launch.q_tile * group) & (row < num_rows)
        q_pos = pos_offset + row
        qt = np.zeros((rows, launch.head_dim), np.float32)
        qt[row_ok] = queries[q_start + first_row + row[row_ok], kv_head * group + r[row_ok] % group]

        end_row = min(-(-min((row_block + 1) * rows, launch.q_tile * group) // group), num_rows)
        hi = pos_offset + end_row
        lo = max(pos_offset + row_block * rows // group - window + 1, 0) if window > 0 else 0
        chunk_lo = lo // chunk
        chunk_hi = -(-hi // chunk) if hi > lo else chunk_lo
        per_split = -(-(chunk_hi - chunk_lo) // splits)
        chunk_begin = chunk_lo + split * per_split
        m_i, l_i = np.full(rows, float(_MASKED.value), np.float32), np.zeros(rows, np.float32)
        acc_i = np.zeros((rows, launch.head_dim), np.float32)
        for c in range(chunk_begin, min(chunk_begin + per_split, chunk_hi)):
            k_pos = c * chunk + np.arange(chunk)
            k_ok = (k_pos < kv_len) & (k_pos // launch.block_size < launch.max_blocks)
            block_id = np.where(k_ok, tables[seq, np.minimum(k_pos // launch.block_size, launch.max_blocks - 1)], 0)
            k, v = (np.where(k_ok[:, None], pages[kv, block_id, k_pos % launch.block_size, kv_head], 0)
                    .astype(np.float32) for kv in (0, 1))
            s = (qt @ k.T) * np.float32(sm_scale)
            if cap > 0:
                with np.errstate(over="ignore"):
                    s = cap * (1.0 - 2.0 / (np.exp(2.0 * (s / cap)) + 1.0))
            mask = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if window > 0:
                mask &= q_pos[:, None] - k_pos[None, :] < window
            s = np.where(mask, s, np.float32(_MASKED.value)).astype(np.float32)
            m_new = np.maximum(m_i, s.max(axis=1))
            p = np.where(mask, np.exp(s - m_new[:, None]), 0.0).astype(np.float32)
            alpha = np.exp(m_i - m_new)
            l_i = l_i * alpha + p.sum(axis=1)
            acc_i = acc_i * alpha[:, None] + p.astype(dot_dtype).astype(np.float32) @ v
            m_i = m_new
        out_rows = slice(row_block * rows, (row_block + 1) * rows)
        acc[tile, kv_head, split, out_rows], m_out[tile, kv_head, split, out_rows] = acc_i, m_i
        l_out[tile, kv_head, split, out_rows] = l_i
    return _combine(jnp.asarray(acc), jnp.asarray(m_out), jnp.asarray(l_out), launch, *tokens, q.dtype)
