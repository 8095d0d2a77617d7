"""The W8A16 / W4A16 kernel on Mosaic GPU in GPU interpret mode (on CPU) against the jnp reference, on
each weight format the engine holds, and its lowering for Hopper."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import use_abstract_mesh

from jaxpaged.kernels.mosaic_matmul import default_splits, mosaic_matmul_plan, quantized_matmul_mosaic
from jaxpaged.kernels.quantized_matmul import quantized_matmul_reference
from tests.kernels.test_pallas_attention import _H100
from tests.kernels.test_quantized_matmul import FORMATS, weight


# K 256: one or several scale groups a step (GGUF's 32), 384: a per-channel walk of three 128-row steps
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,dtype,k", [(1, jnp.float32, 256), (5, jnp.bfloat16, 256), (20, jnp.float32, 384),
                                          (64, jnp.bfloat16, 512)])
def test_matches_the_reference(fmt, rows, dtype, k):
    values, scale, offset, statics = weight(fmt, k, 128)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, k)), dtype)
    want = quantized_matmul_reference(x, values, scale, offset, **statics)
    got = quantized_matmul_mosaic(x, values, scale, offset, **statics, interpret=True, max_slots=2)
    assert got.shape == (rows, 128) and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2       # the weight de-quantized as the reference does it
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                               atol=tol * float(jnp.abs(want.astype(jnp.float32)).max()))


@pytest.mark.parametrize("fmt", ["int8", "Q4_0", "int4 / Q4_1"])
def test_split_k_sums_to_the_same_product(fmt):
    """The K steps shared among programs (split-K): each split's fp32 partial, summed, is the whole product."""
    values, scale, offset, statics = weight(fmt, 1024, 128)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 1024)), jnp.float32)
    want = quantized_matmul_reference(x, values, scale, offset, **statics)
    steps = values.shape[0] // mosaic_matmul_plan(x, values, scale, offset, **statics, interpret=True)[1]
    assert steps == 8
    got = quantized_matmul_mosaic(x, values, scale, offset, **statics, interpret=True, max_slots=2, num_splits=4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    with pytest.raises(ValueError, match="num_splits"):
        quantized_matmul_mosaic(x, values, scale, offset, **statics, interpret=True, num_splits=3)


def test_default_splits_give_every_sm_a_program():
    assert default_splits(64, 32, sms=132) == 4       # a 4096-wide weight: 64 column programs -> 256
    assert default_splits(256, 32, sms=132) == 1      # the columns alone fill the SMs
    assert default_splits(16, 12, sms=132) == 3       # at most a split per 4 steps, and a divisor of them
    assert default_splits(16, 7, sms=132) == 1        # a prime number of steps stays whole


@pytest.mark.parametrize("fmt", ["int8", "fp8", "Q8_0", "Q4_0", "int4 / Q4_1"])
def test_lowers_to_one_mosaic_gpu_kernel_for_hopper(fmt):
    """K 2048 over 256 columns: 4 column programs, the K steps split among programs (fp32 partials)."""
    values, scale, offset, statics = weight(fmt, 2048, 256)
    x = jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16)
    with use_abstract_mesh(_H100):
        text = jax.jit(functools.partial(quantized_matmul_mosaic, **statics)).trace(
            x, values, scale, offset).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert re.search(r"-> tensor<(1024|2048)x8xf32>", text)      # 4 or 8 splits (a step of 128 or 64 rows)


@pytest.mark.parametrize("fmt,k,n,dtype,interpret,reason", [
    ("int8", 256, 96, jnp.bfloat16, True, "multiple of 64"),        # columns in 64s
    ("Q4_0", 192, 128, jnp.bfloat16, True, "rows of values"),       # 96 rows of bytes: not whole 64-row steps
    ("int8", 256, 128, jnp.float32, False, "bfloat16 or float16"),  # fp32 only in interpret mode
])
def test_weights_it_cannot_tile_are_refused_by_name(fmt, k, n, dtype, interpret, reason):
    values, scale, offset, statics = weight(fmt, k, n)
    x = jnp.ones((2, k), dtype)
    assert mosaic_matmul_plan(x, values, scale, offset, **statics, interpret=interpret) is None
    with pytest.raises(ValueError, match=reason):
        quantized_matmul_mosaic(x, values, scale, offset, **statics, interpret=interpret)


def test_the_model_takes_the_mosaic_kernel_where_it_fits(monkeypatch):
    """quantized_matmul="pallas": the Mosaic kernel for weights it tiles, the Triton-lowered one for others."""
    from jaxpaged.kernels import mosaic_matmul, quantized_matmul
    from jaxpaged.models.quantization import QuantizedWeight, matmul_kernel
    calls = []
    for module, name in ((mosaic_matmul, "quantized_matmul_mosaic"), (quantized_matmul, "quantized_matmul_pallas")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    kernel = matmul_kernel("pallas")
    for n in (128, 96):
        values, scale, offset, statics = weight("int8", 256, n)
        w = QuantizedWeight(values=values, scale=scale, offset=offset, bits=8, group_size=256)
        x = jnp.ones((3, 256), jnp.float32)
        want = quantized_matmul_reference(x, values, scale, offset, **statics)
        np.testing.assert_allclose(kernel(x, w), want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    assert calls == ["quantized_matmul_mosaic", "quantized_matmul_pallas"]
