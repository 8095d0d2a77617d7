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
