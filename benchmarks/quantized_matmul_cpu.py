"""Why the quantized weight format is hand-written: one decode-shaped matmul per approach on a CPU.

    pip install qwix && python -m benchmarks.quantized_matmul_cpu

For SmolLM2's [576 x 3072] gate/up and [1536 x 576] down projections at 32 and 512 rows: fp32,
int8 per channel (cast-then-matmul, de-quantize-then-matmul, and qwix's `dot` on its `QArray`), and
4-bit in groups of 32 (a per-group einsum, de-quantize-then-matmul, and qwix). Mean of 20 calls
after one compiling call, in ms. qwix is not a dependency of jaxpaged; without it those
columns are skipped.
"""

import time

import numpy as np


def bench(f, *args, reps: int = 20) -> float:
    import jax
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> int:
    import jax.numpy as jnp
    try:
        import qwix
    except ImportError:
        qwix = None
    rng = np.random.default_rng(0)
    for k, n in [(576, 3072), (1536, 576)]:
        for t in (32, 512):
            x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32)
            s = jnp.max(jnp.abs(w), 0) / 127
            q = jnp.round(w / s).astype(jnp.int8)
            res = {"fp32": bench(lambda x, w: x @ w, x, w),
                   "int8 cast": bench(lambda x, q, s: (x @ q.astype(x.dtype)) * s, x, q, s),
                   "int8 dequant": bench(lambda x, q, s: x @ (q.astype(x.dtype) * s), x, q, s)}
            g = k // 32
            groups = w.reshape(g, 32, n)
            low, high = groups.min(1), groups.max(1)
            scale = (high - low) / 15
            q4 = jnp.clip(jnp.round((groups - low[:, None]) / scale[:, None]), 0, 15).astype(jnp.uint8)

            def grouped(x, q4, scale, low):
                xg = x.reshape(t, g, 32)
                y = jnp.einsum("tgk,gkn->tgn", xg, q4.astype(x.dtype))
                return jnp.einsum("tgn,gn->tn", y, scale) + jnp.einsum("tg,gn->tn", xg.sum(-1), low)

            def dequantized(x, q4, scale, low):
                return x @ (q4.astype(x.dtype) * scale[:, None] + low[:, None]).reshape(k, n)

            res["4-bit einsum"] = bench(grouped, x, q4, scale, low)
            res["4-bit dequant"] = bench(dequantized, x, q4, scale, low)
            if qwix is not None:
                int8 = qwix.quantize(w, jnp.int8, channelwise_axes=[1])
                int4 = qwix.quantize(w, jnp.int4, channelwise_axes=[1], tiled_axes={0: 32})
                res["qwix int8"] = bench(lambda x, a: qwix.dot(x, a), x, int8)
                res["qwix int4/32"] = bench(lambda x, a: qwix.dot(x, a), x, int4)
            print(f"[{t} x {k}] @ [{k} x {n}]: " + ", ".join(f"{name} {ms:.3f}" for name, ms in res.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
