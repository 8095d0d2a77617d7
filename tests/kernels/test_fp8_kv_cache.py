"""An fp8 KV pool (kv_cache_dtype="fp8", "fp8_e5m2"): what write_kv stores, and every attention
backend reading it (scales folded into the queries and the output by `scaled_attention`) against
the reference over the same pool de-quantized to fp32."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import use_abstract_mesh

from jaxpaged.kernels.layout import (as_storage, calibrated_kv_scale, fp8_values, kv_pool_shape, kv_storage_dtype,
                                     scaled_attention, write_kv)
from jaxpaged.kernels.pallas_attention import ragged_paged_attention_pallas
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from tests.kernels.cases import live_tokens, random_case
from tests.kernels.test_pallas_attention import _H100
from tests.kernels.test_triton_attention import REPO, emulate_kernel, lower_for_gpu

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
STORAGE = {jnp.float8_e4m3fn: jnp.uint8, jnp.float8_e5m2: jnp.int8}
SCALE = jnp.asarray([0.05, 3.0], jnp.float32)   # K, V of the layer read


def fp8_case(seed: int, fp8, dtype=jnp.float32, **overrides):
    """A random case whose pool is stored in fp8 (divided by SCALE in the layer read), and that pool
    de-quantized to fp32 for the reference."""
    case = dict(head_dim=64, group=4, block_size=16, num_seqs=4, dtype=dtype, sliding_window=0, soft_cap=0.0)
    q, pool, layer, md, kwargs = random_case(np.random.default_rng(seed), **{**case, **overrides})
    pool = pool.astype(jnp.float32)
    scales = jnp.ones((pool.shape[0], 2), jnp.float32).at[layer].set(SCALE)[:, :, None, None, None, None]
    values = jnp.clip(pool / scales, -float(jnp.finfo(fp8).max), float(jnp.finfo(fp8).max)).astype(fp8)
    stored = as_storage(values, STORAGE[fp8])   # the pool holds the values' bytes
    return q, stored, values.astype(jnp.float32) * scales, layer, md, kwargs


def check(out, want, md, tol):
    n = live_tokens(md)
    err = float(jnp.max(jnp.abs(out[:n].astype(jnp.float32) - want[:n].astype(jnp.float32))))
    assert np.isfinite(err) and err < tol, err


@pytest.mark.parametrize("kv_cache_dtype,expected", [("auto", jnp.bfloat16), ("fp8", jnp.uint8),
                                                     ("fp8_e4m3", jnp.uint8), ("fp8_e5m2", jnp.int8)])
def test_kv_cache_dtype_names(kv_cache_dtype, expected):
    assert kv_storage_dtype(kv_cache_dtype, jnp.bfloat16) == expected
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        kv_storage_dtype("int8", jnp.float32)


@pytest.mark.parametrize("fp8", FP8)
def test_write_kv_stores_values_divided_by_the_layer_scales(fp8):
    rng = np.random.default_rng(0)
    pool = jnp.zeros(kv_pool_shape(2, 4, 8, 2, 16), STORAGE[fp8])
    k = jnp.asarray(rng.standard_normal((5, 2, 16)) * 0.1, jnp.float32)
    v = jnp.asarray(rng.standard_normal((5, 2, 16)) * 30, jnp.float32)
    v = v.at[0, 0, 0].set(1e6)   # beyond fp8's range: clipped to its largest finite value, not NaN
    slots = jnp.asarray([9, 10, 11, 24, -1], jnp.int32)
    pool = write_kv(pool, jnp.int32(1), k, v, slots, SCALE)
    assert pool.dtype == STORAGE[fp8] and fp8_values(pool).dtype == fp8
    back = fp8_values(pool).astype(jnp.float32)
    rel = 2.0 ** -3 if fp8 == jnp.float8_e4m3fn else 2.0 ** -2   # half a step of 3 (e4m3) or 2 mantissa bits
    for t, slot in enumerate([9, 10, 11, 24]):
        block, offset = divmod(slot, 8)
        got_k, got_v = back[1, 0, block, :, offset] * SCALE[0], back[1, 1, block, :, offset] * SCALE[1]
        np.testing.assert_allclose(got_k, k[t], rtol=rel, atol=1e-3)
        want_v = v[t]
        if t == 0:
            assert float(back[1, 1, block, 0, offset, 0]) == float(jnp.finfo(fp8).max)
            got_v, want_v = got_v.at[0, 0].set(0.0), want_v.at[0, 0].set(0.0)
        np.testing.assert_allclose(got_v, want_v, rtol=rel, atol=1e-1)
    assert float(jnp.abs(back[0]).max()) == 0.0   # the other layer is untouched


def test_calibrated_scales_skip_non_finite_values():
    """A first batch with an overflowed value (inf in float16) still calibrates finite scales from the
    rest; padding rows (slot -1) do not count; a scale already set is kept."""
    k = jnp.asarray([[[1.0, -4.0]], [[jnp.inf, 2.0]], [[100.0, 0.0]]], jnp.float16)
    v = jnp.asarray([[[0.5, jnp.nan]], [[-8.0, 1.0]], [[100.0, 0.0]]], jnp.float16)
    slots = jnp.asarray([0, 1, -1], jnp.int32)
    fp8_max = float(jnp.finfo(jnp.float8_e4m3fn).max)
    scales = calibrated_kv_scale(jnp.zeros((2,), jnp.float32), k, v, slots, jnp.uint8)
    np.testing.assert_allclose(np.asarray(scales), [4.0 / fp8_max, 8.0 / fp8_max], rtol=1e-6)
    kept = calibrated_kv_scale(jnp.asarray([0.5, 0.0], jnp.float32), k, v, slots, jnp.uint8)
    np.testing.assert_allclose(np.asarray(kept), [0.5, 8.0 / fp8_max], rtol=1e-6)


REFERENCE_PATHS = [dict(), dict(decode_only=True, q_tile=1), dict(sliding_window=9, soft_cap=5.0)]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("overrides", REFERENCE_PATHS)
def test_reference_reads_fp8_pools(fp8, overrides):
    q, stored, dequantized, layer, md, kwargs = fp8_case(1, fp8, **overrides)
    want = ragged_paged_attention_reference(q, dequantized, layer, md, **kwargs)
    got = scaled_attention(ragged_paged_attention_reference, q, stored, layer, md, kwargs.pop("sliding_window"),
                           SCALE[None][0], **kwargs)
    check(got, want, md, 1e-4)


@pytest.mark.parametrize("fp8,dtype", [(jnp.float8_e4m3fn, jnp.float32), (jnp.float8_e5m2, jnp.bfloat16)])
def test_pallas_reads_fp8_pools(fp8, dtype):
    q, stored, dequantized, layer, md, kwargs = fp8_case(2, fp8, dtype, sliding_window=7)
    want = ragged_paged_attention_reference(q, dequantized.astype(dtype), layer, md, **kwargs)
    kernel = functools.partial(ragged_paged_attention_pallas, num_kv_splits=2, interpret=True)
    got = scaled_attention(kernel, q, stored, layer, md, kwargs.pop("sliding_window"), SCALE, **kwargs)
    check(got, want, md, 1e-4 if dtype == jnp.float32 else 3e-2)


@pytest.mark.parametrize("fp8,dtype", [(jnp.float8_e4m3fn, jnp.bfloat16), (jnp.float8_e5m2, jnp.float32)])
def test_triton_launch_reads_fp8_pools(fp8, dtype):
    """The numpy replay of the Triton launch (pages cast to q's dtype)."""
    q, stored, dequantized, layer, md, kwargs = fp8_case(3, fp8, dtype, soft_cap=4.0)
    want = ragged_paged_attention_reference(q, dequantized.astype(dtype), layer, md, **kwargs)
    got = scaled_attention(emulate_kernel, q, stored, layer, md, kwargs.pop("sliding_window"), SCALE, **kwargs)
    check(got, want, md, 1e-4 if dtype == jnp.float32 else 3e-2)


INTERPRETER_SCRIPT = """
import json, numpy as np, torch, jax.numpy as jnp
from jaxpaged.kernels import triton_attention as ta
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from tests.kernels.cases import live_tokens
from jaxpaged.kernels.layout import fp8_values
from tests.kernels.test_fp8_kv_cache import fp8_case
q, stored, dequantized, layer, md, kwargs = fp8_case(4, jnp.float8_e4m3fn, sliding_window=9)
launch, operands, out_type, meta, tokens = ta.kernel_call_args(q, stored, layer, md, **kwargs, kv_chunk_blocks=2)
def tensor(x):
    return torch.from_numpy(np.array(x))
outs = [torch.zeros(o.shape, dtype=torch.float32) for o in out_type]
ta._paged_attention_kernel[launch.grid](*(tensor(x) for x in operands), *outs, **meta)
got = ta.combine_splits(*(jnp.asarray(o.numpy()) for o in outs), launch, tokens, jnp.float32)
# the scales are the caller's (scaled_attention): compare against the stored values themselves
want = ragged_paged_attention_reference(q, fp8_values(stored).astype(jnp.float32), layer, md, **kwargs)
print(json.dumps(float(jnp.abs(got - want)[:live_tokens(md)].max())))
"""


def test_triton_code_under_interpreter_reads_fp8_pools():
    pytest.importorskip("torch")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.strip().splitlines()[-1]) < 1e-5


def test_pallas_lowers_for_cuda_with_an_fp8_pool():
    q, stored, _, layer, md, kwargs = fp8_case(5, jnp.float8_e4m3fn, jnp.bfloat16)
    kernel = functools.partial(ragged_paged_attention_pallas, sm_scale=kwargs["sm_scale"], num_kv_splits=1)
    with use_abstract_mesh(_H100):
        text = jax.jit(kernel).trace(q, stored, layer, md, kwargs["sliding_window"]).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_triton_kernel_compiles_for_sm90_with_an_fp8_pool():
    pytest.importorskip("jax_triton")
    result = lower_for_gpu("NVIDIA H200", jnp.bfloat16, 128, 4, 16, 16, pool_dtype=jnp.uint8)
    assert ".target sm_90a" in result.binary and "mma" in result.binary
