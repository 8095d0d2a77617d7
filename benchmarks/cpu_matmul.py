"""The native CPU matmul against XLA's, on the layer matmuls of SmolLM2-135M as the scan runs them.

    python -m benchmarks.cpu_matmul

Each row is 30 layers (a `lax.scan`) of SmolLM2's four f32 layer matmuls (q/k/v 576x960, o 576x576,
gate/up 576x3072, down 1536x576) on M token rows, from [30, K, N] stacks: XLA slices the layer's
weights out of each stack and multiplies (what the model did before the native matmul); the native
kernel reads them where they lie. Best and median of 12 calls after one to compile, the two
interleaved.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.cpu_matmul import matmul_cpu

LAYERS = 30
SHAPES = {"wqkv": (576, 960), "wo": (576, 576), "w_gate_up": (576, 3072), "w_down": (1536, 576)}


def layers_fn(native: bool):
    @jax.jit
    def layers(x, stacks):
        def body(h, layer):
            for name, (k, n) in SHAPES.items():
                inp = jnp.tile(h, (1, -(-k // h.shape[1])))[:, :k]
                if native:
                    out = matmul_cpu(inp, stacks[name], layer)
                else:
                    out = inp @ jax.lax.dynamic_index_in_dim(stacks[name], layer, keepdims=False)
                h = h + 1e-2 * out[:, :h.shape[1]]
            return h, None
        return jax.lax.scan(body, x, jnp.arange(LAYERS, dtype=jnp.int32))[0]
    return layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,128,512", help="comma-separated token counts M")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    stacks = {name: jnp.asarray(rng.standard_normal((LAYERS, k, n), np.float32) * 0.05)
              for name, (k, n) in SHAPES.items()}
    flops_per_row = 2 * LAYERS * sum(k * n for k, n in SHAPES.values())
    fns = {"native": layers_fn(True), "xla": layers_fn(False)}
    print(f"{'rows':>5s} {'native best/median ms':>22s} {'xla best/median ms':>20s} {'ratio':>6s} "
          f"{'native GFLOP/s':>15s}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 576), np.float32))
        outs = {name: np.asarray(fn(x, stacks)) for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for _ in range(12):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(x, stacks).block_until_ready()
                times[name].append(time.perf_counter() - start)
        nat, xla = (np.array(times[name]) * 1e3 for name in ("native", "xla"))
        err = float(np.abs(outs["native"] - outs["xla"]).max())
        print(f"{rows:5d} {nat.min():10.1f} / {np.median(nat):7.1f} {xla.min():9.1f} / {np.median(xla):7.1f} "
              f"{np.median(xla) / np.median(nat):5.2f}x {flops_per_row * rows / np.median(nat) / 1e6:12.1f}"
              f"   (max abs difference {err:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
