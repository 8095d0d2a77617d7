"""Weight-only quantized matmul for decode-shaped activations (few rows): W8A16 and W4A16.

    y[M, N] = x[M, K] @ W,   W[k, n] = (values[k, n] - zero) * scale[k // group, n] + offset[k // group, n]

Weights as `jaxpaged.models.quantization.QuantizedWeight` lays them out (this package imports nothing
from jaxpaged, so they come as arrays):

    bits 8   values int8 | float8_e4m3fn [K, N]
    bits 4   values uint8 [K // 2, N]: byte row i holds input row 2i (low nibble) and 2i + 1 (high)
    scale    f32[K // group_size, N]  (group_size == K: one scale per output channel)
    offset   f32[K // group_size, N] or None (GGUF's Q4_1 minimums)

The Pallas kernel (GPU, Triton lowering) never materialises the full-precision weight: each program
owns `block_n` output columns of `block_m` rows and walks K one group at a time (64 rows when the
scales are per channel), de-quantizing that tile in registers before its dot. A 4-bit tile's low and
high nibbles meet the even and odd input columns, which the wrapper splits once, so nothing is
interleaved inside the kernel. `quantized_matmul_reference` is the jnp ground truth.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

_BLOCK_M = 16            # tl.dot needs every dimension >= 16
_CHANNEL_STEP = 64       # K rows per step when the scales are per channel


def dequantize(values, scale, offset, *, bits: int, group_size: int, zero: int, dtype) -> jax.Array:
    """The full-precision [K, N] weight."""
    v = values
    if bits == 4:
        v = jnp.stack([v & 15, v >> 4], axis=1).reshape(2 * v.shape[0], v.shape[1])
    v = v.astype(jnp.float32) - zero
    k, n = v.shape
    w = v.reshape(k // group_size, group_size, n) * scale[:, None, :]
    if offset is not None:
        w = w + offset[:, None, :]
    return w.reshape(k, n).astype(dtype)


def quantized_matmul_reference(x, values, scale, offset=None, *, bits: int, group_size: int, zero: int = 0):
    return jnp.matmul(x, dequantize(values, scale, offset, bits=bits, group_size=group_size, zero=zero,
                                    dtype=x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def validate_quantized_matmul(x, values, scale, offset, bits, group_size):
    """Shape and dtype checks shared by the quantized matmul kernels; raises ValueError naming the argument."""
    if x.ndim != 2 or values.ndim != 2:
        raise ValueError(f"x and values must be 2-D, got shapes {x.shape} and {values.shape}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    k = values.shape[0] * (2 if bits == 4 else 1)
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k} input rows")
    if group_size < 1 or k % group_size:
        raise ValueError(f"group_size must divide the weight's {k} input rows, got {group_size}")
    if group_size != k and group_size % 32:
        raise ValueError(f"group_size must be a multiple of 32 (or the whole input), got {group_size}")
    if scale.shape != (k // group_size, values.shape[1]):
        raise ValueError(f"scale must have shape {(k // group_size, values.shape[1])}, got {scale.shape}")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"offset must have the scale's shape {scale.shape}, got {offset.shape}")
    if bits == 4 and values.dtype != jnp.uint8:
        raise ValueError(f"4-bit values must be uint8 (two per byte), got {values.dtype}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"x dtype must be float32, bfloat16 or float16, got {x.dtype}")


def _block_n(n: int) -> int:
    for b in (128, 64, 32, 16):
        if n % b == 0:
            return b
    raise ValueError(f"the weight's output size must be a multiple of 16, got {n}")


def _kernel(*refs, bits, step, num_steps, per_channel, zero, has_offset, dtype):
    if bits == 4:
        x_lo_ref, x_hi_ref, values_ref, scale_ref, *rest = refs
    else:
        x_ref, values_ref, scale_ref, *rest = refs
    offset_ref = rest[0] if has_offset else None
    out_ref = rest[-1]
    rows = step // 2 if bits == 4 else step     # value rows per step

    def body(i, acc):
        v = values_ref[pl.ds(i * rows, rows), :]
        if bits == 4:
            x_lo = x_lo_ref[:, pl.ds(i * rows, rows)]
            x_hi = x_hi_ref[:, pl.ds(i * rows, rows)]
            lo = ((v & 15).astype(jnp.float32) - zero).astype(dtype)
            hi = ((v >> 4).astype(jnp.float32) - zero).astype(dtype)
            part = (jax.lax.dot(x_lo, lo, preferred_element_type=jnp.float32)
                    + jax.lax.dot(x_hi, hi, preferred_element_type=jnp.float32))
            x_sum = None if not has_offset else (jnp.sum(x_lo.astype(jnp.float32), axis=1, keepdims=True)
                                                 + jnp.sum(x_hi.astype(jnp.float32), axis=1, keepdims=True))
        else:
            x = x_ref[:, pl.ds(i * rows, rows)]
            w = v.astype(jnp.float32) if zero == 0 else v.astype(jnp.float32) - zero
            part = jax.lax.dot(x, w.astype(dtype), preferred_element_type=jnp.float32)
            x_sum = None if not has_offset else jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)
        if per_channel:
            return acc + part
        acc = acc + part * scale_ref[pl.ds(i, 1), :]
        if has_offset:
            acc = acc + x_sum * offset_ref[pl.ds(i, 1), :]
        return acc

    acc = jax.lax.fori_loop(0, num_steps, body, jnp.zeros(out_ref.shape, jnp.float32))
    if per_channel:
        acc = acc * scale_ref[...]
    out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "zero", "interpret"))
def quantized_matmul_pallas(x, values, scale, offset=None, *, bits: int, group_size: int, zero: int = 0,
                            interpret: bool = False) -> jax.Array:
    """x [M, K] @ the quantized [K, N] weight -> [M, N] in x's dtype, fp32 accumulation. Raises
    ValueError for shapes or dtypes the kernel cannot handle."""
    validate_quantized_matmul(x, values, scale, offset, bits, group_size)
    m, k = x.shape
    n = values.shape[1]
    per_channel = group_size == k and offset is None   # one group with offsets walks as a group
    step = _CHANNEL_STEP if per_channel and k % _CHANNEL_STEP == 0 else 32 if per_channel else group_size
    if k % step:
        raise ValueError(f"per-channel weights need input rows divisible by 32, got {k}")
    block_n = _block_n(n)
    padded_m = pl.cdiv(m, _BLOCK_M) * _BLOCK_M
    x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
    if bits == 4:   # even and odd input columns meet the low and high nibbles
        xs = [x[:, 0::2], x[:, 1::2]]
        x_specs = [pl.BlockSpec((_BLOCK_M, k // 2), lambda i, j: (i, 0))] * 2
    else:
        xs = [x]
        x_specs = [pl.BlockSpec((_BLOCK_M, k), lambda i, j: (i, 0))]
    groups = scale.shape[0]
    weights = [values, scale] + ([offset] if offset is not None else [])
    weight_specs = [pl.BlockSpec((values.shape[0], block_n), lambda i, j: (0, j)),
                    pl.BlockSpec((groups, block_n), lambda i, j: (0, j))]
    if offset is not None:
        weight_specs.append(pl.BlockSpec((groups, block_n), lambda i, j: (0, j)))
    kernel = functools.partial(_kernel, bits=bits, step=step, num_steps=k // step, per_channel=per_channel,
                               zero=zero, has_offset=offset is not None, dtype=x.dtype)
    out = pl.pallas_call(
        kernel,
        grid=(padded_m // _BLOCK_M, n // block_n),
        in_specs=x_specs + weight_specs,
        out_specs=pl.BlockSpec((_BLOCK_M, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded_m, n), x.dtype),
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"w{bits}a16_matmul",
    )(*xs, *weights)
    return out[:m]
