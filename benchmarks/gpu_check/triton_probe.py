"""The smallest jax-triton call (an elementwise add), to tell whether a jax-triton build works here.

Imported only by the probe: importing it needs `triton`.
"""

import inspect

import triton
import triton.language as tl


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask),
             mask=mask)


def output_keyword(jax_triton) -> str:
    """The name triton_call gives its output shapes: 'out_type' (jax-triton 0.4) or 'out_shape' (0.3)."""
    params = inspect.signature(jax_triton.triton_call).parameters
    return "out_type" if "out_type" in params else "out_shape"


def run_add(n: int = 1000) -> float:
    """Max abs error of a Triton add through jax-triton on the default GPU."""
    import jax
    import jax.numpy as jnp
    import jax_triton

    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    y = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
    out = jax_triton.triton_call(x, y, kernel=_add_kernel, grid=(triton.cdiv(n, 128),), N=n, BLOCK=128,
                                 **{output_keyword(jax_triton): jax.ShapeDtypeStruct((n,), jnp.float32)})
    return float(jnp.abs(out - (x + y)).max())
