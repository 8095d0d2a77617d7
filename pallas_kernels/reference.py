"""Ragged paged attention in plain jnp: the ground truth and the CPU path.

Queries of a mixed batch (decodes with one new token, prompt chunks with many) are cut
into tiles of `q_tile` tokens, each tile belonging to one sequence:

    flat tokens  | seq0: 5 tokens  | seq1: 1 | seq2: 3 |      (q_tile = 2)
    tiles        | t0 | t1 | t2    | t3      | t4 | t5 |

Each tile walks its sequence's KV in chunks of `kv_chunk_blocks` pages with an online
softmax, so memory stays O(tiles x chunk) whatever the context length. Tiles go
`tiles_per_group` at a time: only the groups holding a tile in use, each only as far as its
tiles' last visible key (not a compiled bucket, not the batch's longest context).

A decode-only batch (`md.decode_only`) takes a second path: every page any sequence reads
goes into one flat list, walked `pages_per_chunk` pages at a time (see `_flat_pages_attention`).
The work is then the pages in use, not sequences x the longest context.
"""

import functools

import jax
import jax.numpy as jnp

from jaxpaged.kernels.layout import fp8_values, gather_pages
from jaxpaged.kernels.metadata import AttentionMetadata

_MASKED = -1e30


def num_query_tiles(num_tokens: int, num_seqs: int, q_tile: int) -> int:
    """Static upper bound on tiles: each sequence wastes at most one partial tile."""
    if q_tile == 1:
        return num_tokens
    return num_tokens // q_tile + num_seqs


def validate_inputs(q: jax.Array, kv_pool: jax.Array, md: AttentionMetadata) -> None:
    """Shape and dtype checks shared by every kernel; raises ValueError naming the argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {q.shape}")
    if kv_pool.ndim != 6 or kv_pool.shape[1] != 2:
        raise ValueError("kv_pool must be [num_layers, 2, num_blocks, kv_heads, block_size, head_dim], "
                         f"got shape {kv_pool.shape}")
    num_heads, head_dim = q.shape[1:]
    kv_heads = kv_pool.shape[3]
    if kv_pool.shape[5] != head_dim:
        raise ValueError(f"kv_pool head_dim {kv_pool.shape[5]} != q head_dim {head_dim}")
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    num_seqs = md.kv_lens.shape[0]
    if md.cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must have shape ({num_seqs + 1},), got {md.cu_q_lens.shape}")
    if md.block_tables.ndim != 2 or md.block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {md.block_tables.shape}")
    if md.q_tile < 1:
        raise ValueError(f"q_tile must be >= 1, got {md.q_tile}")
    for name in ("kv_lens", "block_tables", "cu_q_lens"):
        if not jnp.issubdtype(getattr(md, name).dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {getattr(md, name).dtype}")


def tile_layout(md: AttentionMetadata, num_tokens: int):
    """Per tile: owning sequence, first query row (in the sequence), validity; per token: its tile/row."""
    q_tile = md.q_tile
    num_seqs = md.kv_lens.shape[0]
    num_tiles = num_query_tiles(num_tokens, num_seqs, q_tile)
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    tiles_per_seq = (q_lens + q_tile - 1) // q_tile
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_per_seq).astype(jnp.int32)])
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.clip(jnp.searchsorted(cu_tiles[1:], tile_ids, side="right", method="compare_all"), 0, num_seqs - 1)
    tile_valid = tile_ids < cu_tiles[-1]
    tile_first_row = (tile_ids - cu_tiles[tile_seq]) * q_tile

    token_ids = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = jnp.clip(jnp.searchsorted(md.cu_q_lens[1:], token_ids, side="right", method="compare_all"), 0, num_seqs - 1)
    token_row = token_ids - md.cu_q_lens[token_seq]
    token_tile = jnp.clip(cu_tiles[token_seq] + token_row // q_tile, 0, num_tiles - 1)
    return q_lens, tile_seq, tile_valid, tile_first_row, token_tile, token_row % q_tile


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_chunk_blocks", "pages_per_chunk", "tiles_per_group"))
def ragged_paged_attention_reference(
    q: jax.Array, kv_pool: jax.Array, layer: jax.Array, md: AttentionMetadata,
    sliding_window: jax.Array | int = 0, soft_cap: float | jax.Array = 0.0, *, sm_scale: float,
    sinks: jax.Array | None = None,   # [num_heads] (gpt-oss): a logit per head that joins each softmax's sum
    kv_chunk_blocks: int = 8,    # pages per step of a tile's walk (mixed batches)
    tiles_per_group: int = 8,    # query tiles walked together (mixed batches)
    pages_per_chunk: int = 128,  # pages per step of the flat walk (decode-only batches), at most 16 per seq
) -> jax.Array:
    """The ground truth of every attention backend (backends.AttentionFn: the arguments and result)."""
    validate_inputs(q, kv_pool, md)
    for name, value in (("kv_chunk_blocks", kv_chunk_blocks), ("pages_per_chunk", pages_per_chunk),
                        ("tiles_per_group", tiles_per_group)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [num_heads] ({q.shape[1]},), got shape {sinks.shape}")
    if md.decode_only:
        return _flat_pages_attention(q, kv_pool, layer, md, sliding_window, soft_cap, sinks, sm_scale=sm_scale,
                                     pages_per_chunk=pages_per_chunk)
    return _tiled_attention(q, kv_pool, layer, md, sliding_window, soft_cap, sinks, sm_scale=sm_scale,
                            kv_chunk_blocks=kv_chunk_blocks, tiles_per_group=tiles_per_group)


def _softmax_start(sinks: jax.Array | None, shape: tuple[int, ...], kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """The online softmax's first (max, sum) [.., kv_heads, group, ..] = shape: nothing seen yet, or each
    head's sink as a key with logit sinks[h] and value 0 (it adds exp(sink - max) to the sum only)."""
    if sinks is None:
        return jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32)
    per_head = sinks.astype(jnp.float32).reshape(kv_heads, -1)
    per_head = per_head.reshape((1, kv_heads, per_head.shape[1]) + (1,) * (len(shape) - 3))
    return jnp.broadcast_to(per_head, shape), jnp.ones(shape, jnp.float32)


def _soft_capped(s: jax.Array, cap: jax.Array) -> jax.Array:
    return jnp.where(cap > 0, cap * jnp.tanh(s / jnp.where(cap > 0, cap, 1.0)), s)


def _tiled_attention(q, kv_pool, layer, md, sliding_window, soft_cap, sinks, *, sm_scale, kv_chunk_blocks,
                     tiles_per_group):
    """Mixed batches: tiles walked `tiles_per_group` at a time, only the groups that hold a tile in
    use, each group only as far as its tiles' last visible key.

        tiles        | seq0: t0 t1 t2 | seq1: t3 | seq2: t4 t5 | padding: t6 ... t(N-1) |
        groups of 2  | g0: t0 t1 | g1: t2 t3 | g2: t4 t5 |  (g3... never run)
        g0 walks up to t1's last query position, g1 up to max(t2's, t3's), ...

    The static tile count bounds a batch of up to num_seqs sequences (each wastes at most one partial
    tile), far more than a prompt chunk or two use: walking every tile to the longest context cost a
    256-token prompt chunk with max_num_seqs 256 eighteen times its work."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, _, kv_heads, block_size, _ = kv_pool.shape
    group = num_heads // kv_heads
    q_tile = md.q_tile
    max_blocks = md.block_tables.shape[1]
    chunk = min(kv_chunk_blocks, max_blocks)

    q_lens, tile_seq, tile_valid, tile_first_row, token_tile, token_tile_row = tile_layout(md, num_tokens)
    num_tiles = tile_seq.shape[0]
    G = max(1, min(tiles_per_group, num_tiles))
    num_groups = -(-num_tiles // G)
    pad = num_groups * G - num_tiles   # the last group's slots past the tiles: invalid tiles

    def padded(x, value=0):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)

    tile_seq, tile_first_row, tile_valid = padded(tile_seq), padded(tile_first_row), padded(tile_valid, False)
    rows = tile_first_row[:, None] + jnp.arange(q_tile, dtype=jnp.int32)[None, :]   # [N, q_tile]
    row_valid = tile_valid[:, None] & (rows < q_lens[tile_seq][:, None])
    q_index = jnp.clip(md.cu_q_lens[tile_seq][:, None] + rows, 0, num_tokens - 1)
    q_tiles = q[q_index].astype(jnp.float32) * sm_scale                            # [N, qt, H, D]
    q_tiles = q_tiles.reshape(*q_index.shape, kv_heads, group, head_dim)
    kv_len = jnp.where(tile_valid, md.kv_lens[tile_seq], 0)                        # [N]
    q_pos = (kv_len - q_lens[tile_seq])[:, None] + rows                            # [N, qt]
    tables = md.block_tables[tile_seq]                                             # [N, max_blocks]
    window = jnp.asarray(sliding_window, jnp.int32)
    cap = jnp.asarray(soft_cap, jnp.float32)
    chunk_tokens = chunk * block_size

    def kv_chunk(kv, block_ids):
        """[G, kv_heads, chunk_tokens, head_dim]: whole blocks gathered, then each head's pages side by side."""
        blocks = gather_pages(kv_pool, layer, kv, block_ids)                        # [G, chunk, h, bs, D]
        return blocks.transpose(0, 2, 1, 3, 4).reshape(G, kv_heads, chunk_tokens, head_dim)

    def group_body(g, out):
        first = g * G
        take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=first, slice_size=G, axis=0)
        gq, g_pos, g_rows, g_tables = (take(x) for x in (q_tiles, q_pos, row_valid, tables))

        def body(c, carry):
            acc, m, l = carry
            block_idx = jnp.clip(c * chunk + jnp.arange(chunk, dtype=jnp.int32), 0, max_blocks - 1)
            block_ids = g_tables[:, block_idx]                                      # [G, chunk]
            k = fp8_values(kv_chunk(0, block_ids)).astype(jnp.float32)
            v = fp8_values(kv_chunk(1, block_ids)).astype(jnp.float32)
            s = _soft_capped(jnp.einsum("nqhgd,nhkd->nhgqk", gq, k), cap)
            k_pos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)   # [ck]
            # a valid row's position is below its kv_len: the causal test keeps keys inside the sequence
            mask = k_pos[None, None, :] <= g_pos[:, :, None]
            mask &= (window <= 0) | (g_pos[:, :, None] - k_pos[None, None, :] < window)
            mask &= g_rows[:, :, None]                                              # [G, qt, ck]
            mask = mask[:, None, None]
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("nhgqk,nhkd->nhgqd", p, v)
            return acc, m_new, l

        m0, l0 = _softmax_start(sinks, (G, kv_heads, group, q_tile), kv_heads)
        acc0 = jnp.zeros((G, kv_heads, group, q_tile, head_dim), jnp.float32)
        # keys the group sees: up to its last valid row (causal); a window hides those before its first
        end = jnp.where(g_rows, g_pos + 1, 0).max()
        begin = jnp.where(g_rows, jnp.maximum(g_pos - window + 1, 0), end).min()
        start = jnp.where(window > 0, begin // chunk_tokens, 0)
        stop = (end + chunk_tokens - 1) // chunk_tokens
        acc, _, l = jax.lax.fori_loop(start, stop, body, (acc0, m0, l0))
        return jax.lax.dynamic_update_slice_in_dim(out, acc / jnp.where(l > 0, l, 1.0)[..., None], first, axis=0)

    groups_in_use = (jnp.sum(tile_valid) + G - 1) // G   # tiles in use come first, sequence by sequence
    out = jnp.zeros((num_groups * G, kv_heads, group, q_tile, head_dim), jnp.float32)
    out = jax.lax.fori_loop(0, groups_in_use, group_body, out)                    # [N, h, g, qt, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_groups * G, q_tile, num_heads, head_dim)
    return out[token_tile, token_tile_row].astype(q.dtype)


def _flat_pages_attention(q, kv_pool, layer, md, sliding_window, soft_cap, sinks, *, sm_scale, pages_per_chunk):
    """Decode-only batches: the pages of all sequences laid end to end, walked in fixed-size chunks.

        pages read   | seq0: 0 1 2 | seq1: 0 | seq2 (window): 3 4 5 | padding seqs: none |
        flat index   |       0 1 2 |       3 |                4 5 6 |

    The tile walk pays sequences x the longest context; this pays the pages in use, whoever
    owns them. A chunk's pages may belong to several sequences: each page yields a partial
    softmax (max, sum, weighted V) of its sequence's single query, merged into that sequence's
    running (max, sum, acc) by segment max / sum over the page owners (sorted: pages are laid
    out sequence by sequence). A one-hot [seqs, pages] matmul would do the same merge at
    num_seqs times the cost, more than the attention itself from about 32 sequences.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, _, kv_heads, block_size, _ = kv_pool.shape
    group = num_heads // kv_heads
    num_seqs, max_blocks = md.block_tables.shape
    # Unused slots of the last chunk cost as much as pages: a few sequences rarely fill a big chunk.
    pages_per_chunk = min(pages_per_chunk, 16 * num_seqs)
    window = jnp.asarray(sliding_window, jnp.int32)
    cap = jnp.asarray(soft_cap, jnp.float32)

    kv_len = md.kv_lens                                                             # [S]
    # The query sits at kv_len - 1; with a window it sees keys from kv_len - window on.
    first_page = jnp.where(window > 0, jnp.maximum(kv_len - window, 0) // block_size, 0)
    num_pages = (kv_len + block_size - 1) // block_size - first_page                # 0 for padding
    pages_end = jnp.cumsum(num_pages).astype(jnp.int32)                             # [S] flat index past seq's pages
    pages_start = pages_end - num_pages
    total_pages = pages_end[-1]
    q_index = jnp.clip(md.cu_q_lens[:-1], 0, num_tokens - 1)
    queries = q[q_index].astype(jnp.float32) * sm_scale
    queries = queries.reshape(num_seqs, kv_heads, group, head_dim)                  # [S, h, g, D]
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    merge = functools.partial(jax.ops.segment_sum, num_segments=num_seqs, indices_are_sorted=True)

    def body(c, carry):
        m, l, acc = carry
        flat = c * pages_per_chunk + jnp.arange(pages_per_chunk, dtype=jnp.int32)   # [P]
        # Slots past the last page (in the last chunk) fall to the last sequence, past its last
        # page: the causal mask hides all their keys, so they add nothing whatever they read.
        seq = jnp.clip(jnp.searchsorted(pages_end, flat, side="right", method="compare_all"), 0, num_seqs - 1)
        page = first_page[seq] + flat - pages_start[seq]                            # [P] index in seq's table
        block_ids = md.block_tables[seq, jnp.clip(page, 0, max_blocks - 1)]
        k, v = (fp8_values(gather_pages(kv_pool, layer, kv, block_ids)).astype(jnp.float32)
                for kv in (0, 1))                                                     # [P, h, bs, D]
        s = _soft_capped(jnp.einsum("phgd,phkd->phgk", queries[seq], k), cap)        # [P, h, g, bs]
        k_pos = page[:, None] * block_size + offsets                                # [P, bs]
        q_pos = kv_len[seq][:, None] - 1
        visible = (k_pos <= q_pos) & ((window <= 0) | (q_pos - k_pos < window))
        visible = visible[:, None, None, :]
        s = jnp.where(visible, s, _MASKED)
        page_max = s.max(axis=-1)                                                   # [P, h, g]
        p = jnp.where(visible, jnp.exp(s - page_max[..., None]), 0.0)
        page_sum = p.sum(axis=-1)
        page_acc = jnp.einsum("phgk,phkd->phgd", p, v)

        # Sequences without a page in this chunk get -inf here and keep their max.
        m_new = jnp.maximum(m, jax.ops.segment_max(page_max, seq, num_segments=num_seqs, indices_are_sorted=True))
        page_weight = jnp.exp(page_max - m_new[seq])                                # [P, h, g]
        alpha = jnp.exp(m - m_new)                                                  # [S, h, g]
        l = l * alpha + merge(page_sum * page_weight, seq)
        acc = acc * alpha[..., None] + merge(page_acc * page_weight[..., None], seq)
        return m_new, l, acc

    m0, l0 = _softmax_start(sinks, (num_seqs, kv_heads, group), kv_heads)
    acc0 = jnp.zeros((num_seqs, kv_heads, group, head_dim), jnp.float32)
    num_chunks = (total_pages + pages_per_chunk - 1) // pages_per_chunk
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, (m0, l0, acc0))
    out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(num_seqs, num_heads, head_dim)
    token_seq = jnp.searchsorted(md.cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right",
                                 method="compare_all")
    return out[jnp.clip(token_seq, 0, num_seqs - 1)].astype(q.dtype)
