"""What the GPU kernels share outside their programs: query tiles in, rows out, split-K merged.

A kernel program owns one (query tile, kv head, kv split). Its rows are the tile's queries x the
query heads of that kv head, query-major:

    row r = query r // group of the tile, head (kv_head * group + r % group)

`tile_queries` lays q out that way (padding rows zero, so garbage in unused q slots stays out
of the dots) with per-tile scalars for the program; `untile` takes the programs' rows back to
[num_tokens, num_heads, head_dim]. With more than one split a program writes its partial
(acc, max, sum) in fp32 and `merge_splits` combines them (flash-decoding).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import tile_layout

# Columns of a tile's scalar row (TileInputs.info).
SEQ, KV_LEN, FIRST_POS, NUM_QUERIES, LAYER, WINDOW = range(6)
INFO_WIDTH = 8


def visible_pages(kv_len, first_pos, num_queries, window, *, block_size: int, max_blocks: int):
    """Pages [first, end) of a tile's block-table row that hold keys some of its queries can see.

    Keys after the tile's last query are causally invisible; keys before its first query's
    window are invisible to every row. Works on traced scalars (in the kernel) and on arrays.
    """
    kv_end = jnp.minimum(kv_len, first_pos + num_queries)
    kv_start = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    first = kv_start // block_size
    end = jnp.minimum((kv_end + block_size - 1) // block_size, max_blocks)
    return first, jnp.maximum(first, end)       # empty for a padding tile


def split_pages(first, end, split, num_splits: int):
    """Pages [begin, stop) of [first, end) that split `split` of `num_splits` walks.

    Sized from the tile's own page count, not the table width (a dynamic split, as in
    flash-decoding): contiguous, counts differing by at most one, so every split has a page
    when the context has at least num_splits of them, and the longest split walks
    cdiv(pages, num_splits) pages whatever max_model_len is.
    """
    pages = end - first
    return first + split * pages // num_splits, first + (split + 1) * pages // num_splits


def kernel_q_tile(q_tile: int, group: int, max_rows: int) -> int:
    """Largest power of two <= q_tile whose rows (q_tile * group) fit one program's max_rows."""
    tile = 1
    while tile * 2 <= q_tile and tile * 2 * group <= max_rows:
        tile *= 2
    return tile


class TileInputs(NamedTuple):
    info: jax.Array        # i32[num_tiles, INFO_WIDTH]: SEQ, KV_LEN, FIRST_POS, NUM_QUERIES, LAYER, WINDOW
    q_tiles: jax.Array     # [num_tiles, kv_heads, rows, head_dim], q's dtype, padding rows zero
    token_tile: jax.Array  # i32[num_tokens]: the tile of each token
    token_row: jax.Array   # i32[num_tokens]: its query inside the tile
    q_tile: int            # queries per tile


def tile_queries(q, md: AttentionMetadata, layer, sliding_window, *, kv_heads: int, max_rows: int,
                 rows: int) -> TileInputs:
    """q cut into tiles of whole queries (q_tile x group <= max_rows), each padded to `rows` rows."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // kv_heads
    q_tile = kernel_q_tile(md.q_tile, group, max_rows)
    q_lens, tile_seq, tile_valid, tile_first_row, token_tile, token_row = tile_layout(
        dataclasses.replace(md, q_tile=q_tile), num_tokens)
    num_tiles = tile_seq.shape[0]
    kv_len = jnp.where(tile_valid, md.kv_lens[tile_seq], 0)
    num_queries = jnp.where(tile_valid, jnp.clip(q_lens[tile_seq] - tile_first_row, 0, q_tile), 0)
    first_pos = kv_len - q_lens[tile_seq] + tile_first_row
    zeros = jnp.zeros_like(kv_len)
    info = jnp.stack([tile_seq, kv_len, first_pos, num_queries,
                      zeros + jnp.asarray(layer, jnp.int32), zeros + jnp.asarray(sliding_window, jnp.int32),
                      zeros, zeros], axis=1).astype(jnp.int32)

    rows_in_tile = jnp.arange(q_tile, dtype=jnp.int32)
    q_index = jnp.clip(md.cu_q_lens[tile_seq][:, None] + tile_first_row[:, None] + rows_in_tile, 0, num_tokens - 1)
    q_valid = rows_in_tile[None, :] < num_queries[:, None]
    q_tiles = jnp.where(q_valid[:, :, None, None], q[q_index], jnp.zeros((), q.dtype))     # [N, qt, H, D]
    q_tiles = q_tiles.reshape(num_tiles, q_tile, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_tiles = q_tiles.reshape(num_tiles, kv_heads, q_tile * group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - q_tile * group), (0, 0)))
    return TileInputs(info, q_tiles, token_tile, token_row, q_tile)


def sink_rows(sinks: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """f32[kv_heads, rows]: the attention sink (gpt-oss, [num_heads]) of each program row, row r holding head
    r % group of its kv head (the padding rows past q_tile x group get one too: they are dropped)."""
    per_head = sinks.astype(jnp.float32).reshape(kv_heads, -1)
    return jnp.tile(per_head, (1, -(-rows // per_head.shape[1])))[:, :rows]


def merge_splits(acc, m, l, sinks=None):
    """[splits, N, h, rows, D] fp32 partials and their [splits, N, h, rows] max and sum -> [N, h, rows, D];
    `sinks` (sink_rows, [h, rows]): each row's sink joins the sum as a key of value 0 (the kernels leave
    it out: a kernel with sinks writes partials even with one split)."""
    m_all = m.max(axis=0)
    if sinks is not None:
        m_all = jnp.maximum(m_all, sinks)
    weight = jnp.exp(m - m_all)
    l = (l * weight).sum(axis=0)
    if sinks is not None:
        l = l + jnp.exp(sinks - m_all)
    acc = (acc * weight[..., None]).sum(axis=0)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def untile(out, tiles: TileInputs, num_heads: int, dtype) -> jax.Array:
    """[num_tiles, kv_heads, rows, head_dim] program rows -> [num_tokens, num_heads, head_dim]."""
    num_tiles, kv_heads, _, head_dim = out.shape
    group = num_heads // kv_heads
    out = out[:, :, :tiles.q_tile * group].reshape(num_tiles, kv_heads, tiles.q_tile, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_tiles, tiles.q_tile, num_heads, head_dim)
    return out[tiles.token_tile, tiles.token_row].astype(dtype)
