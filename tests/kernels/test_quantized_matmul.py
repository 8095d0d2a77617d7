"""The weight-only quantized matmul kernel (W8A16, W4A16) in interpret mode against the jnp
reference, on each weight format the engine holds, and its lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import use_abstract_mesh

from jaxpaged.kernels.quantized_matmul import dequantize, quantized_matmul_pallas, quantized_matmul_reference
from tests.kernels.test_pallas_attention import _H100

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# name -> (bits, group_size (None: per channel), zero, offset?, values dtype)
FORMATS = {"int8": (8, None, 0, False, jnp.int8), "fp8": (8, None, 0, False, jnp.float8_e4m3fn),
           "Q8_0": (8, 32, 0, False, jnp.int8), "Q4_0": (4, 32, 8, False, jnp.uint8),
           "int4 / Q4_1": (4, 32, 0, True, jnp.uint8)}


def weight(fmt: str, k: int, n: int, seed: int = 0):
    bits, group, zero, with_offset, dtype = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    group = group or k
    if bits == 4:
        values = jnp.asarray(rng.integers(0, 256, (k // 2, n)), jnp.uint8)
    elif dtype == jnp.int8:
        values = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    else:
        values = jnp.asarray(rng.standard_normal((k, n)) * 50, jnp.float32).astype(dtype)
    scale = jnp.asarray(rng.uniform(0.001, 0.02, (k // group, n)), jnp.float32)
    offset = jnp.asarray(rng.uniform(-0.1, 0.1, (k // group, n)), jnp.float32) if with_offset else None
    return values, scale, offset, dict(bits=bits, group_size=group, zero=zero)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,dtype,k", [(1, jnp.float32, 192), (5, jnp.bfloat16, 192), (20, jnp.float32, 192),
                                          (48, jnp.float32, 32)])   # 32: one group (a row-parallel shard's)
def test_matches_the_reference(fmt, rows, dtype, k):
    values, scale, offset, statics = weight(fmt, k, 96)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, k)), dtype)
    want = quantized_matmul_reference(x, values, scale, offset, **statics)
    got = quantized_matmul_pallas(x, values, scale, offset, **statics, interpret=True)
    assert got.shape == (rows, 96) and got.dtype == dtype
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                               atol=tol * float(jnp.abs(want.astype(jnp.float32)).max()))


def test_dequantize_unpacks_nibbles_in_row_order():
    values = jnp.asarray([[0x21], [0x43]], jnp.uint8)          # rows 0..3 hold 1, 2, 3, 4
    w = dequantize(values, jnp.ones((1, 1)), None, bits=4, group_size=4, zero=0, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(w)[:, 0], [1, 2, 3, 4])


@pytest.mark.parametrize("change,name", [
    (dict(bits=3), "bits"), (dict(group_size=48), "group_size"), (dict(x_cols=100), "columns"),
])
def test_bad_inputs_are_named(change, name):
    values, scale, offset, statics = weight("Q4_0", 192, 96)
    statics = {**statics, **{k: v for k, v in change.items() if k != "x_cols"}}
    x = jnp.ones((2, change.get("x_cols", 192)), jnp.float32)
    with pytest.raises(ValueError, match=name):
        quantized_matmul_pallas(x, values, scale, offset, **statics, interpret=True)


@pytest.mark.parametrize("fmt", ["int8", "Q4_0", "int4 / Q4_1"])
def test_lowers_to_a_triton_kernel_for_cuda(fmt):
    values, scale, offset, statics = weight(fmt, 576, 1536)
    x = jax.ShapeDtypeStruct((8, 576), jnp.bfloat16)
    with use_abstract_mesh(_H100):
        text = jax.jit(lambda x, v, s, o: quantized_matmul_pallas(x, v, s, o, **statics)).trace(
            x, values, scale, offset).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
