"""The Mosaic GPU kernel in GPU interpret mode (on CPU) against the jnp reference, and its CUDA lowering."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import use_abstract_mesh

from jaxpaged.kernels import mosaic_attention
from jaxpaged.kernels.mosaic_attention import ragged_paged_attention_mosaic
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from tests.kernels.cases import random_case
from tests.kernels.test_fp8_kv_cache import SCALE, check, fp8_case
from tests.kernels.test_pallas_attention import _H100, assert_matches_reference

mosaic = functools.partial(ragged_paged_attention_mosaic, interpret=True)

# (head_dim, group, block_size, num_seqs, dtype, sliding_window, soft_cap, num_kv_splits, q_tile, seed):
# ragged prompt chunks and decodes, block-table holes (shuffled pools, padded columns, padded
# sequences), GQA 1-8 and MQA (kv_heads 1), windows, soft caps, splits; head dims 64/128/256.
CASES = [
    (64, 1, 16, 3, jnp.float32, 0, 0.0, 1, None, 0),
    (64, 4, 8, 4, jnp.float32, 7, 0.0, 3, 4, 2),
    (64, 8, 32, 3, jnp.float32, 0, 30.0, 2, 2, 3),
    (128, 2, 16, 3, jnp.float32, 20, 0.0, None, 8, 7),
    (64, 2, 16, 4, jnp.bfloat16, 0, 0.0, 2, None, 8),
    (64, 8, 8, 4, jnp.bfloat16, 9, 0.0, 1, 8, 9),
    (128, 4, 64, 3, jnp.bfloat16, 0, 10.0, None, 4, 10),
    (256, 1, 16, 2, jnp.bfloat16, 16, 0.0, 3, 2, 11),
    (64, 2, 128, 2, jnp.float32, 100, 0.0, 2, 4, 12),     # pages of 128 keys: two 64-key steps each
]


@pytest.mark.parametrize("head_dim,group,block_size,num_seqs,dtype,window,soft_cap,splits,q_tile,seed", CASES)
def test_matches_reference(head_dim, group, block_size, num_seqs, dtype, window, soft_cap, splits, q_tile, seed):
    rng = np.random.default_rng(seed)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=head_dim, group=group, block_size=block_size,
                                                num_seqs=num_seqs, dtype=dtype, sliding_window=window,
                                                soft_cap=soft_cap, q_tile=q_tile)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    out = mosaic(q, kv_pool, layer, md, **kwargs, num_kv_splits=splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_matches_reference(out, ref, md, dtype)


def test_mqa_long_contexts_in_a_wide_table_with_two_slots():
    """One kv head for 16 query heads, contexts up to ~600 keys in a 256-page table: many steps
    through a two-slot ring (every slot reused), a traced soft cap."""
    rng = np.random.default_rng(25)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=16, block_size=16, num_seqs=2, kv_heads=1,
                                                dtype=jnp.float32, sliding_window=0, soft_cap=20.0,
                                                max_blocks_per_seq=40, decode_only=True)
    md = dataclasses.replace(md, block_tables=jnp.pad(md.block_tables, ((0, 0), (0, 256 - md.block_tables.shape[1]))))
    kwargs["soft_cap"] = jnp.float32(20.0)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    out = mosaic(q, kv_pool, layer, md, **kwargs, num_kv_splits=1, max_slots=2)
    assert_matches_reference(out, ref, md, jnp.float32)


@pytest.mark.parametrize("fp8,dtype", [(jnp.float8_e4m3fn, jnp.bfloat16), (jnp.float8_e5m2, jnp.float32)])
def test_fp8_pool_matches_the_dequantized_reference(fp8, dtype):
    from jaxpaged.kernels.layout import scaled_attention
    q, stored, dequantized, layer, md, kwargs = fp8_case(31, fp8, dtype=dtype)
    want = ragged_paged_attention_reference(q.astype(jnp.float32), dequantized, layer, md, **kwargs)
    out = scaled_attention(mosaic, q, stored, layer, md, kwargs.pop("sliding_window"), SCALE, **kwargs)
    check(out, want, md, 5e-2 if dtype == jnp.bfloat16 else 2e-3)


def test_a_program_that_never_runs_is_caught(monkeypatch):
    """The comparison notices a tile whose program never ran: interpret mode leaves its rows NaN."""
    real_kernel = plgpu.kernel

    def one_tile_short(body, *, grid, **params):
        return real_kernel(body, grid=(grid[0] - 1, *grid[1:]), **params)

    rng = np.random.default_rng(13)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=2, block_size=16, num_seqs=3,
                                                dtype=jnp.float32, q_tile=1, pad_tokens=0)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    monkeypatch.setattr(mosaic_attention.plgpu, "kernel", one_tile_short)
    jax.clear_caches()
    try:
        out = mosaic(q, kv_pool, layer, md, **kwargs, num_kv_splits=1)
    finally:
        jax.clear_caches()
    with pytest.raises(AssertionError, match="never written"):
        assert_matches_reference(out, ref, md, jnp.float32)


def _lower_for_hopper(head_dim, dtype, num_kv_splits, kv_dtype=None, soft_cap=0.0, block_size=16, group=4):
    q, kv_pool, layer, md, kwargs = random_case(np.random.default_rng(14), head_dim=head_dim, group=group,
                                                block_size=block_size, num_seqs=3, dtype=dtype, sliding_window=8,
                                                max_blocks_per_seq=2)
    if kv_dtype is not None:
        kv_pool = kv_pool.astype(kv_dtype)
    kernel = functools.partial(ragged_paged_attention_mosaic, sm_scale=kwargs["sm_scale"], soft_cap=soft_cap,
                               num_kv_splits=num_kv_splits)
    with use_abstract_mesh(_H100):
        return jax.jit(kernel).trace(q, kv_pool, layer, md, kwargs["sliding_window"]).lower(
            lowering_platforms=("cuda",))


@pytest.mark.parametrize("head_dim,dtype,splits,kv_dtype,soft_cap,block_size,group", [
    (64, jnp.bfloat16, 1, None, 30.0, 16, 4),
    (128, jnp.bfloat16, 2, None, 0.0, 8, 8),
    (256, jnp.float16, 1, None, 0.0, 128, 1),     # the most shared memory: 64-key slices of big pages
    (128, jnp.bfloat16, 1, jnp.uint8, 0.0, 256, 16),   # fp8 e4m3 pool: widened through f32
    (256, jnp.float16, 3, jnp.int8, 0.0, 64, 2),  # fp8 e5m2 pool: widened straight to f16
])
def test_lowers_to_one_mosaic_gpu_kernel_for_hopper(head_dim, dtype, splits, kv_dtype, soft_cap, block_size, group):
    """Mosaic GPU's own lowering for an H100, run here: layouts inferred, TMA and wgmma shapes and the
    shared memory the kernel takes (at most 227 KiB) checked; the GPU path (P in registers, the
    accumulator updated in place) that interpret mode does not run."""
    text = _lower_for_hopper(head_dim, dtype, splits, kv_dtype, soft_cap, block_size, group).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


def _small_case(**overrides):
    spec = dict(head_dim=64, group=2, block_size=16, num_seqs=2, dtype=jnp.float32) | overrides
    return random_case(np.random.default_rng(15), **spec)


@pytest.mark.parametrize("overrides,call_kwargs,argument", [
    (dict(head_dim=80), {}, "head_dim"),
    (dict(head_dim=16), {}, "head_dim"),
    (dict(block_size=4), {}, "block_size"),
    (dict(group=128, kv_heads=1), {}, "num_heads // kv_heads"),
    ({}, dict(num_kv_splits=0), "num_kv_splits"),
    ({}, dict(max_slots=1), "max_slots"),
])
def test_invalid_arguments_are_named(overrides, call_kwargs, argument):
    q, kv_pool, layer, md, kwargs = _small_case(**overrides)
    with pytest.raises(ValueError, match=argument):
        mosaic(q, kv_pool, layer, md, **kwargs, **call_kwargs)


def test_float32_is_refused_on_the_gpu_path_and_mixed_dtypes_everywhere():
    q, kv_pool, layer, md, kwargs = _small_case()
    with pytest.raises(ValueError, match="bfloat16 or float16 on a GPU"):
        ragged_paged_attention_mosaic(q, kv_pool, layer, md, **kwargs)
    with pytest.raises(ValueError, match="kv_pool dtype"):
        mosaic(q, kv_pool.astype(jnp.bfloat16), layer, md, **kwargs)
