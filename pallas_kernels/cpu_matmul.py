"""A dense f32 matmul through a native kernel on a CPU (cpu_matmul.cc, in the cpu_native library).

In the scanned layer loop, XLA:CPU slices each layer's weights out of their [layers, K, N] stack into
a copy before the dot (it does not fuse a dynamic slice into a matmul), so a decode step wrote the
whole model once more before multiplying. `matmul_cpu(x, stacked, layer)` reads the layer's weights
where they lie; its register tiles also beat XLA's dot at the few rows of a decode step. Against the
slice and XLA's dot, the four matmuls of 30 SmolLM2 layers (`python -m benchmarks.cpu_matmul`):
see docs/results.md, "A native CPU matmul"."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpaged.kernels import cpu_native

TARGET = "jaxpaged_matmul"


class LayerOfStack(NamedTuple):
    """One layer's weight inside a scan, not sliced out: the [num_layers, K, N] stack and the index
    (what `matmul_cpu(x, stack, layer)` takes)."""
    stack: jax.Array
    layer: jax.Array


def supports(x: jax.Array, w: jax.Array) -> bool:
    """Whether the native kernel takes x @ w (w: [K, N], or a stack [layers, K, N] indexed by layer)."""
    return (x.dtype == jnp.float32 and w.dtype == jnp.float32 and x.ndim == 2 and w.ndim in (2, 3)
            and x.shape[1] == w.shape[-2])


def matmul_cpu(x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, live: jax.Array | int | None = None
               ) -> jax.Array:
    """x @ w for w [K, N], or x @ w[layer] for w [layers, K, N] (to f32 rounding: the sums run in
    another order than XLA's). `layer` must be in range (an error at run time, not a clamp).
    `live` (traced, default all): only x's first `live` rows are multiplied, y's other rows are zeros
    (a step's padding tokens, which follow its real ones, cost nothing); clamped to [0, M]."""
    if not supports(x, w):
        raise ValueError(f"matmul_cpu takes f32 x [M, K] and w [K, N] or [layers, K, N], got "
                         f"{x.dtype}{list(x.shape)} and {w.dtype}{list(w.shape)}")
    if cpu_native.load() is None:
        raise RuntimeError("matmul_cpu needs the native CPU kernels, which did not build (see the log)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[-1]), x.dtype))
    live = x.shape[0] if live is None else live
    return call(x, w, jnp.asarray(layer, jnp.int32), jnp.asarray(live, jnp.int32))
