"""The Pallas kernel (interpret mode on CPU) against the jnp reference, and its CUDA lowering."""

import dataclasses
import functools
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from jaxpaged.kernels.pallas_attention import ragged_paged_attention_pallas
from jaxpaged.kernels.tiling import split_pages, visible_pages
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from tests.kernels.cases import live_tokens, random_case

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

_TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
_H100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H100", num_cores=132,
                                                                 platform="cuda"))


def assert_matches_reference(out, ref, md, dtype):
    """Every live row written (interpret mode leaves unwritten outputs NaN) and close to the reference."""
    n = live_tokens(md)
    out = np.asarray(out[:n], np.float32)
    ref = np.asarray(ref[:n], np.float32)
    assert np.isfinite(ref).all()
    assert np.isfinite(out).all(), f"rows never written or poisoned: {np.unique(np.nonzero(~np.isfinite(out))[0])}"
    err = np.abs(out - ref).max()
    assert err < _TOLERANCE[dtype], f"max abs error {err}"


# (head_dim, group, block_size, num_seqs, dtype, sliding_window, soft_cap, kv_chunk_blocks, num_kv_splits, seed)
CASES = [
    (64, 1, 16, 1, jnp.float32, 0, 0.0, 8, None, 0),
    (64, 2, 8, 3, jnp.float32, 0, 0.0, 2, None, 1),
    (64, 4, 16, 5, jnp.float32, 7, 0.0, 1, 3, 2),
    (64, 8, 32, 8, jnp.float32, 0, 30.0, 8, 2, 3),
    (128, 1, 8, 4, jnp.float32, 12, 0.0, 2, 1, 4),
    (128, 2, 32, 2, jnp.float32, 0, 0.0, 1, 4, 5),
    (128, 4, 8, 6, jnp.float32, 0, 5.0, 8, None, 6),
    (128, 8, 16, 3, jnp.float32, 20, 0.0, 1, 2, 7),
    (64, 2, 16, 4, jnp.bfloat16, 0, 0.0, 1, 2, 8),
    (64, 8, 8, 7, jnp.bfloat16, 9, 0.0, 4, None, 9),
    (128, 4, 32, 5, jnp.bfloat16, 0, 10.0, 8, None, 10),
    (128, 1, 16, 8, jnp.bfloat16, 16, 0.0, 2, 3, 11),
]


@pytest.mark.parametrize("head_dim,group,block_size,num_seqs,dtype,window,soft_cap,chunk,splits,seed", CASES)
def test_matches_reference(head_dim, group, block_size, num_seqs, dtype, window, soft_cap, chunk, splits, seed):
    rng = np.random.default_rng(seed)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=head_dim, group=group, block_size=block_size,
                                                num_seqs=num_seqs, dtype=dtype, sliding_window=window,
                                                soft_cap=soft_cap)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    out = ragged_paged_attention_pallas(q, kv_pool, layer, md, **kwargs, kv_chunk_blocks=chunk,
                                        num_kv_splits=splits, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches_reference(out, ref, md, dtype)


def test_decode_batch_matches_the_flat_reference():
    """The kernel ignores `decode_only`; the reference then walks the pages flat, 4 at a time."""
    rng = np.random.default_rng(16)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=4, block_size=16, num_seqs=6,
                                                dtype=jnp.float32, sliding_window=20, decode_only=True, pad_seqs=2,
                                                max_blocks_per_seq=5)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs, pages_per_chunk=4)
    out = ragged_paged_attention_pallas(q, kv_pool, layer, md, **kwargs, interpret=True)
    assert_matches_reference(out, ref, md, jnp.float32)


def test_big_prompt_tile_and_traced_soft_cap():
    """q_tile x group beyond one program's rows is re-tiled; a soft cap may arrive as an array."""
    rng = np.random.default_rng(12)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=8, block_size=16, num_seqs=2,
                                                dtype=jnp.float32, q_tile=32, soft_cap=20.0)
    kwargs["soft_cap"] = jnp.float32(20.0)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    out = ragged_paged_attention_pallas(q, kv_pool, layer, md, **kwargs, interpret=True)
    assert_matches_reference(out, ref, md, jnp.float32)


def _wide_table(md, width):
    """The same batch with a block table `width` columns wide, as a long max_model_len gives it."""
    tables = md.block_tables
    return dataclasses.replace(md, block_tables=jnp.pad(tables, ((0, 0), (0, width - tables.shape[1]))))


@pytest.mark.parametrize("num_splits", [1, 3, 4, 16])
def test_split_pages_share_the_visible_pages_evenly(num_splits):
    first = 5
    for pages in range(0, 41):
        begin, stop = (np.asarray(x) for x in split_pages(first, first + pages, np.arange(num_splits), num_splits))
        assert begin[0] == first and stop[-1] == first + pages
        np.testing.assert_array_equal(begin[1:], stop[:-1])        # contiguous, no page walked twice
        counts = stop - begin
        assert counts.max() - counts.min() <= 1
        assert (counts > 0).sum() == min(pages, num_splits)         # a short context still uses every split


def test_visible_pages_follow_the_tile_not_the_table():
    page_range = functools.partial(visible_pages, block_size=8, max_blocks=512)
    # decode at kv_len 33: pages 0..4 of 512
    assert tuple(map(int, page_range(33, 32, 1, 0))) == (0, 5)
    # a window of 10 keys: positions 23..32, pages 2..4
    assert tuple(map(int, page_range(33, 32, 1, 10))) == (2, 5)
    # the first tile of a prompt chunk sees up to its last query, not the whole context
    assert tuple(map(int, page_range(40, 20, 4, 0))) == (0, 3)
    # padding tile, and a kv_len past the table (clamped)
    first, end = page_range(0, -3, 0, 0)
    assert int(first) == int(end)
    assert int(page_range(5000, 4999, 1, 0)[1]) == 512


# Contexts of 1-39 tokens (block_size 8, <= 4 blocks) in a table 512 blocks wide.
# (group, window, soft_cap, dtype, num_kv_splits, seed)
SHORT_CONTEXT_CASES = [
    (1, 0, 0.0, jnp.float32, 4, 20),
    (4, 0, 0.0, jnp.float32, None, 21),
    (2, 6, 0.0, jnp.float32, 3, 22),
    (8, 0, 25.0, jnp.float32, 4, 23),
    (4, 11, 10.0, jnp.bfloat16, 2, 24),
]


@pytest.mark.parametrize("group,window,soft_cap,dtype,splits,seed", SHORT_CONTEXT_CASES)
def test_short_contexts_in_a_wide_table_match_reference(group, window, soft_cap, dtype, splits, seed):
    rng = np.random.default_rng(seed)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=group, block_size=8, num_seqs=3,
                                                dtype=dtype, sliding_window=window, soft_cap=soft_cap,
                                                max_blocks_per_seq=4)
    md = _wide_table(md, 512)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    out = ragged_paged_attention_pallas(q, kv_pool, layer, md, **kwargs, num_kv_splits=splits, interpret=True)
    assert_matches_reference(out, ref, md, dtype)


# (group, window, kv_chunk_blocks, num_kv_splits, seed): contexts up to ~650 tokens, block_size 16.
@pytest.mark.parametrize("group,window,chunk,splits,seed", [(4, 0, 4, 3, 25), (2, 100, 2, 5, 26)])
def test_long_contexts_match_reference(group, window, chunk, splits, seed):
    rng = np.random.default_rng(seed)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=group, block_size=16, num_seqs=2,
                                                dtype=jnp.float32, sliding_window=window, max_blocks_per_seq=40)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    out = ragged_paged_attention_pallas(q, kv_pool, layer, md, **kwargs, kv_chunk_blocks=chunk,
                                        num_kv_splits=splits, interpret=True)
    assert_matches_reference(out, ref, md, jnp.float32)


def test_a_short_context_is_spread_over_every_split(monkeypatch):
    """Split-K follows the context, not the table: in a 512-page table, a context of P pages gives
    min(P, 4) of 4 splits keys (a nonzero softmax sum); a split fixed by the table width gave all to one."""
    real_pallas_call = pl.pallas_call
    partial_sums = []

    def record_partial_sums(kernel, **params):
        call = real_pallas_call(kernel, **params)

        def run(*args):
            acc, m, l = call(*args)
            jax.debug.callback(lambda l: partial_sums.append(np.asarray(l)), l)
            return acc, m, l
        return run

    rng = np.random.default_rng(27)
    num_splits, group, block_size = 4, 2, 8
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=group, block_size=block_size, num_seqs=5,
                                                dtype=jnp.float32, decode_only=True, max_blocks_per_seq=4)
    md = _wide_table(md, 512)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    monkeypatch.setattr(pl, "pallas_call", record_partial_sums)
    jax.clear_caches()
    try:
        out = ragged_paged_attention_pallas(q, kv_pool, layer, md, **kwargs, num_kv_splits=num_splits,
                                            interpret=True)
        jax.effects_barrier()
    finally:
        jax.clear_caches()
    assert_matches_reference(out, ref, md, jnp.float32)

    (l,) = partial_sums                                   # [splits, tiles, kv_heads, rows]
    kv_lens = np.asarray(md.kv_lens)[:live_tokens(md)]    # q_tile 1, one query each: tile i is sequence i
    pages = -(-kv_lens // block_size)
    assert pages.max() >= num_splits and pages.min() < num_splits, pages
    splits_with_keys = (l[:, :len(kv_lens), :, :group] > 0).all(axis=(2, 3)).sum(axis=0)
    np.testing.assert_array_equal(splits_with_keys, np.minimum(pages, num_splits))


def test_a_kernel_that_skips_a_tile_is_caught(monkeypatch):
    """The comparison above notices a program that never runs: its rows stay poisoned (NaN)."""
    real_pallas_call = pl.pallas_call

    def grid_one_tile_short(kernel, *, grid, **params):
        return real_pallas_call(kernel, grid=(grid[0] - 1, *grid[1:]), **params)

    # q_tile 1 and no padded tokens: one tile per live token, so the missing tile is a live row.
    rng = np.random.default_rng(13)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=2, block_size=16, num_seqs=3,
                                                dtype=jnp.float32, q_tile=1, pad_tokens=0)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    monkeypatch.setattr(pl, "pallas_call", grid_one_tile_short)
    jax.clear_caches()
    try:
        out = ragged_paged_attention_pallas(q, kv_pool, layer, md, **kwargs, interpret=True)
    finally:
        jax.clear_caches()
    with pytest.raises(AssertionError, match="never written"):
        assert_matches_reference(out, ref, md, jnp.float32)


def _lower_for_cuda(head_dim, dtype, num_kv_splits):
    rng = np.random.default_rng(14)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=head_dim, group=4, block_size=16, num_seqs=3,
                                                dtype=dtype, sliding_window=8)
    kernel = functools.partial(ragged_paged_attention_pallas, sm_scale=kwargs["sm_scale"],
                               num_kv_splits=num_kv_splits)
    with use_abstract_mesh(_H100):
        return jax.jit(kernel).trace(q, kv_pool, layer, md, kwargs["sliding_window"]).lower(
            lowering_platforms=("cuda",))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_a_triton_kernel_for_cuda(head_dim, dtype):
    text = _lower_for_cuda(head_dim, dtype, num_kv_splits=2 if dtype == jnp.float32 else 1).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("head_dim,dtype", [(128, jnp.bfloat16), (64, jnp.float32)])
def test_triton_compiles_it_for_sm90(monkeypatch, head_dim, dtype, tmp_path):
    """Beyond lowering: Triton's own compiler turns the kernel into a Hopper cubin without spills."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from jax._src.pallas.triton import pallas_call_registration as registration
    if not hasattr(getattr(registration, "lowering", None), "lower_jaxpr_to_triton_module"):
        pytest.skip("this jax no longer exposes the Triton module to capture")

    modules = []
    real_lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kw):
        result = real_lower(*args, **kw)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)
    text = _lower_for_cuda(head_dim, dtype, num_kv_splits=2).as_text()
    options = {name: int(re.search(rf"{name} = (\d+)", text).group(1)) for name in ("num_warps", "num_stages")}
    source = tmp_path / "kernel.ttir"
    source.write_text(modules[0])
    compiled = triton.compile(str(source), target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.metadata.shared <= 227 * 1024
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    (tmp_path / "kernel.ptx").write_text(compiled.asm["ptx"])
    report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(tmp_path / "kernel.ptx"), "-o",
                             str(tmp_path / "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    assert re.search(r"\b0 bytes spill stores", report), report


def _small_case(**overrides):
    spec = dict(head_dim=64, group=2, block_size=16, num_seqs=2, dtype=jnp.float32) | overrides
    return random_case(np.random.default_rng(15), **spec)


@pytest.mark.parametrize("overrides,call_kwargs,argument", [
    (dict(head_dim=80), {}, "head_dim"),
    (dict(block_size=12), {}, "block_size"),
    ({}, dict(kv_chunk_blocks=0), "kv_chunk_blocks"),
    ({}, dict(num_kv_splits=0), "num_kv_splits"),
])
def test_invalid_arguments_are_named(overrides, call_kwargs, argument):
    q, kv_pool, layer, md, kwargs = _small_case(**overrides)
    with pytest.raises(ValueError, match=argument):
        ragged_paged_attention_pallas(q, kv_pool, layer, md, **kwargs, **call_kwargs, interpret=True)


def test_invalid_shapes_and_dtypes_are_named():
    q, kv_pool, layer, md, kwargs = _small_case()
    with pytest.raises(ValueError, match="num_heads"):
        ragged_paged_attention_pallas(q[:, :3], kv_pool, layer, md, **kwargs, interpret=True)
    with pytest.raises(ValueError, match="q dtype"):
        ragged_paged_attention_pallas(q.astype(jnp.int32), kv_pool, layer, md, **kwargs, interpret=True)
