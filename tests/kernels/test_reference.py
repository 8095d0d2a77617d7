"""The jnp reference itself, both paths, against attention written out query by query in numpy.

The reference is the ground truth the kernels are compared with, so it gets an independent
check: `naive_attention` loops over queries and heads in float64 with nothing shared but the
pool layout. Decode-only batches take the flat-pages path; it is also compared with the tile
walk on the same inputs, with chunks small enough that pages of one sequence straddle chunks.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels.layout import write_kv
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from tests.kernels.cases import live_tokens, random_case

_TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def naive_attention(q, kv_pool, layer, md, sliding_window, soft_cap, sm_scale, sinks=None) -> np.ndarray:
    """[num_tokens, num_heads, head_dim] float64; rows of padded tokens are NaN. `sinks` [num_heads]: a
    logit per head in the softmax's sum (gpt-oss), as transformers concatenates and drops it."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    pool = np.asarray(kv_pool[int(layer)].astype(jnp.float32), np.float64)   # [2, blocks, kv_heads, bs, D]
    kv_lens, tables, cu_q_lens = (np.asarray(x) for x in (md.kv_lens, md.block_tables, md.cu_q_lens))
    kv_heads, block_size = pool.shape[2], pool.shape[3]
    group = q.shape[1] // kv_heads
    window = int(sliding_window)
    out = np.full(q.shape, np.nan)
    for seq, kv_len in enumerate(kv_lens):
        q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
        keys = np.arange(kv_len)
        blocks = tables[seq, keys // block_size]
        k, v = pool[0, blocks, :, keys % block_size], pool[1, blocks, :, keys % block_size]   # [kv_len, h, D]
        for row in range(q_len):
            token, pos = cu_q_lens[seq] + row, kv_len - q_len + row
            visible = (keys <= pos) & ((window <= 0) | (pos - keys < window))
            for head in range(q.shape[1]):
                s = k[visible, head // group] @ q[token, head] * sm_scale
                if soft_cap > 0:
                    s = soft_cap * np.tanh(s / soft_cap)
                if sinks is not None:
                    s = np.append(s, float(sinks[head]))
                p = np.exp(s - s.max())
                out[token, head] = p[:visible.sum()] @ v[visible, head // group] / p.sum()
    return out


def assert_close(got, want, md, dtype):
    n = live_tokens(md)
    got = np.asarray(got[:n].astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"poisoned rows: {np.unique(np.nonzero(~np.isfinite(got))[0])}"
    err = np.abs(got - want[:n]).max()
    assert err < _TOLERANCE[dtype], f"max abs error {err}"


# (block_size, group, sliding_window, soft_cap, dtype, pages_per_chunk, seed)
DECODE_CASES = [
    (8, 1, 0, 0.0, jnp.float32, 4, 0),
    (8, 4, 11, 0.0, jnp.float32, 1, 1),
    (16, 2, 0, 20.0, jnp.float32, 4, 2),
    (16, 4, 21, 0.0, jnp.float32, 128, 3),
    (32, 1, 40, 5.0, jnp.float32, 4, 4),
    (32, 2, 0, 0.0, jnp.float32, 3, 5),
    (8, 2, 0, 30.0, jnp.bfloat16, 4, 6),
    (16, 4, 9, 0.0, jnp.bfloat16, 128, 7),
]


@pytest.mark.parametrize("block_size,group,window,soft_cap,dtype,pages_per_chunk,seed", DECODE_CASES)
def test_decode_batches_match_naive_attention(block_size, group, window, soft_cap, dtype, pages_per_chunk, seed):
    """Both paths on decode batches with padded sequences, NaN padded tokens and contexts of up to
    six pages, so that a sequence's pages straddle chunks of `pages_per_chunk`."""
    rng = np.random.default_rng(seed)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=group, block_size=block_size, num_seqs=7,
                                                dtype=dtype, sliding_window=window, soft_cap=soft_cap,
                                                decode_only=True, pad_seqs=3, max_blocks_per_seq=5)
    want = naive_attention(q, kv_pool, layer, md, **kwargs)
    flat = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs, pages_per_chunk=pages_per_chunk)
    tiled = ragged_paged_attention_reference(q, kv_pool, layer, dataclasses.replace(md, decode_only=False),
                                             **kwargs, kv_chunk_blocks=2)
    assert flat.shape == q.shape and flat.dtype == q.dtype
    assert_close(flat, want, md, dtype)
    assert_close(tiled, want, md, dtype)


@pytest.mark.parametrize("tiles_per_group", [1, 3, 8])
@pytest.mark.parametrize("block_size,group,window,soft_cap,q_tile,seed", [
    (8, 2, 0, 0.0, 4, 10),
    (16, 4, 13, 0.0, 8, 11),
    (8, 2, 9, 0.0, 2, 13),
    (32, 1, 0, 10.0, 2, 12),
])
def test_mixed_batches_match_naive_attention(block_size, group, window, soft_cap, q_tile, seed, tiles_per_group):
    """Tiles walked one, three or eight at a time (the groups in use only, each from its window's
    first chunk to its last visible key) over contexts of up to eight pages, two pages a chunk."""
    rng = np.random.default_rng(seed)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=32, group=group, block_size=block_size, num_seqs=5,
                                                dtype=jnp.float32, sliding_window=window, soft_cap=soft_cap,
                                                q_tile=q_tile, max_blocks_per_seq=8, pad_seqs=3)
    got = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs, kv_chunk_blocks=2,
                                           tiles_per_group=tiles_per_group)
    assert_close(got, naive_attention(q, kv_pool, layer, md, **kwargs), md, jnp.float32)


@pytest.mark.parametrize("decode_only", [True, False])
def test_attention_sinks_join_each_softmax_as_a_key_without_value(decode_only):
    """gpt-oss's sinks (a learned logit per head, some far above the scores) in both paths."""
    rng = np.random.default_rng(30)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=32, group=2, block_size=8, num_seqs=5,
                                                dtype=jnp.float32, sliding_window=9, decode_only=decode_only,
                                                max_blocks_per_seq=4, pad_seqs=2)
    sinks = jnp.asarray([-2.0, 0.5, 3.0, 8.0], jnp.float32)   # [kv_heads 2 x group 2]
    got = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs, sinks=sinks, kv_chunk_blocks=2)
    want = naive_attention(q, kv_pool, layer, md, **kwargs, sinks=np.asarray(sinks))
    assert_close(got, want, md, jnp.float32)
    plain = naive_attention(q, kv_pool, layer, md, **kwargs)
    assert np.abs(want - plain)[:live_tokens(md)].max() > 0.1   # the sinks change every row's weights


def test_flat_path_spans_many_chunks_like_the_tile_walk():
    """A bigger decode batch (about 100 pages, walked 8 at a time) gives the tile walk's output."""
    rng = np.random.default_rng(20)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=2, block_size=8, num_seqs=12,
                                                dtype=jnp.float32, sliding_window=50, decode_only=True,
                                                pad_seqs=4, max_blocks_per_seq=14)
    flat = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs, pages_per_chunk=8)
    tiled = ragged_paged_attention_reference(q, kv_pool, layer, dataclasses.replace(md, decode_only=False),
                                             **kwargs)
    n = live_tokens(md)
    np.testing.assert_allclose(np.asarray(flat[:n]), np.asarray(tiled[:n]), atol=1e-5, rtol=1e-5)


def test_a_sequence_with_huge_logits_leaves_the_others_alone():
    """Pages of several sequences share a chunk, but each sequence keeps its own running max:
    under a shared one, sequence 0's logits (query x300) would underflow every other exp to 0."""
    q, kv_pool, layer, md, kwargs = random_case(np.random.default_rng(24), head_dim=64, group=2, block_size=8,
                                                num_seqs=4, dtype=jnp.float32, decode_only=True)
    q = q.at[0].multiply(300.0)
    got = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    assert_close(got, naive_attention(q, kv_pool, layer, md, **kwargs), md, jnp.float32)


def test_all_padding_batch_gives_zeros():
    """Warm-up compiles on batches with no live sequence (here with NaN tokens): nothing to walk, zeros out."""
    q, kv_pool, layer, md, kwargs = random_case(np.random.default_rng(21), head_dim=32, group=2, block_size=8,
                                                num_seqs=0, dtype=jnp.float32, decode_only=True, pad_seqs=4,
                                                pad_tokens=4)
    out = np.asarray(ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs))
    np.testing.assert_array_equal(out, np.zeros(q.shape, np.float32))


@pytest.mark.parametrize("argument", ["kv_chunk_blocks", "pages_per_chunk", "tiles_per_group"])
def test_invalid_chunk_sizes_are_named(argument):
    q, kv_pool, layer, md, kwargs = random_case(np.random.default_rng(22), head_dim=32, group=2, block_size=8,
                                                num_seqs=2, dtype=jnp.float32, decode_only=True)
    with pytest.raises(ValueError, match=argument):
        ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs, **{argument: 0})


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_write_kv_puts_each_head_in_its_page(kv_heads):
    """Token t of slot s lands at pool[layer, K|V, s // block_size, head, s % block_size]; slot -1 nowhere."""
    num_layers, num_blocks, block_size, head_dim = 2, 5, 4, 8
    pool = jnp.zeros((num_layers, 2, num_blocks, kv_heads, block_size, head_dim), jnp.float32)
    rng = np.random.default_rng(23)
    k = rng.standard_normal((4, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((4, kv_heads, head_dim)).astype(np.float32)
    slots = np.array([5, -1, 19, 0], np.int32)
    got = np.asarray(write_kv(pool, jnp.int32(1), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)))
    want = np.zeros(pool.shape, np.float32)
    for token, slot in enumerate(slots):
        if slot >= 0:
            want[1, 0, slot // block_size, :, slot % block_size] = k[token]
            want[1, 1, slot // block_size, :, slot % block_size] = v[token]
    np.testing.assert_array_equal(got, want)


def _pool_sized_copies(hlo: str, size: int) -> list[str]:
    """Instructions of optimized HLO that copy an array of `size` elements (plain or fused copies)."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]", line)
        if m and "copy" in line.split("=", 1)[1] and math.prod(int(d) for d in m.group(1).split(",") if d) == size:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("decode_only", [True, False])   # the flat-pages path and the tile walk
def test_a_layer_writes_and_reads_the_pool_in_place(kv_heads, decode_only):
    """A layer's K/V write and the reference attention's page reads leave the donated pool where it is:
    with one KV head (MQA, or tensor parallelism as wide as the KV heads) XLA on CPU copied the whole
    pool twice a layer for a [rows, head_dim] view of it (a decode step of 1 s against 1 ms at 1 GiB)."""
    q, kv_pool, layer, md, kwargs = random_case(np.random.default_rng(5), head_dim=64, group=2, block_size=16,
                                                num_seqs=2, dtype=jnp.float32, kv_heads=kv_heads,
                                                decode_only=decode_only)
    kv_pool = jnp.zeros((2, 2, 512, *kv_pool.shape[3:]), kv_pool.dtype)
    slots = jnp.arange(q.shape[0], dtype=jnp.int32)

    def layer_step(pool, q):
        k = q[:, :kv_heads]
        pool = write_kv(pool, layer, k, k, slots)
        return pool, ragged_paged_attention_reference(q, pool, layer, md, **kwargs)

    hlo = jax.jit(layer_step, donate_argnums=0).lower(kv_pool, q).compile().as_text()
    assert _pool_sized_copies(hlo, kv_pool.size) == []


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def test_an_earlier_owners_overflowed_v_does_not_reach_the_next_owner(kernel):
    """A block's slots past the end of the sequence holding it keep what an earlier owner wrote there:
    V that overflowed (inf, NaN) is stored as 0, so the masked keys' zero weights cannot make NaN (0 x
    inf) of the new owner's output."""
    from jaxpaged.kernels.mosaic_attention import ragged_paged_attention_mosaic

    attention = (ragged_paged_attention_reference if kernel == "reference"
                 else functools.partial(ragged_paged_attention_mosaic, interpret=True))
    q, kv_pool, layer, md, kwargs = random_case(np.random.default_rng(31), head_dim=64, group=2, block_size=8,
                                                num_seqs=3, dtype=jnp.float32)
    clean = attention(q, kv_pool, layer, md, **kwargs)
    tables, kv_lens = np.asarray(md.block_tables), np.asarray(md.kv_lens)
    stale = [tables[i, pos // 8] * 8 + pos % 8 for i, n in enumerate(kv_lens) if n % 8
             for pos in range(n, -(-n // 8) * 8)]
    assert stale
    k = jnp.zeros((len(stale), kv_pool.shape[3], 64), jnp.float32)
    v = jnp.full(k.shape, jnp.inf).at[::2].set(jnp.nan)
    poisoned = write_kv(kv_pool, jnp.int32(layer), k, v, jnp.asarray(stale, jnp.int32))
    out = attention(q, poisoned, layer, md, **kwargs)
    live = live_tokens(md)
    np.testing.assert_allclose(np.asarray(out)[:live], np.asarray(clean)[:live], rtol=1e-5, atol=1e-5)
