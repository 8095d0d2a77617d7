"""Compile time of one step variant against model depth, for each layer loop.

The built-in model's width (SmolLM2-135M: hidden 576, 9/3 heads, vocab 49152) at 30 and 60
layers, zero weights (compile time does not depend on their values), the layers scanned
(`scan_layers=True`, stacked weights) or unrolled (one weight set per layer). Each variant is
compiled from scratch (no compilation cache) in this process: a decode step of 32 sequences
and a step with a prompt chunk of 256 tokens.

    python -m benchmarks.compile_depth [--depths 30 60]
"""

import argparse
import dataclasses
import os
import time


def _runner(cfg, scan_layers: bool):
    import jax.numpy as jnp

    from jaxpaged.models.llama import LlamaFamilyForCausalLM, layer_weight_shapes, weight_shapes
    from jaxpaged.runner.model_runner import ModelRunner

    weights = {name: jnp.zeros(shape, jnp.float32) for name, shape in weight_shapes(cfg).items()}
    layer_shapes = layer_weight_shapes(cfg)
    if scan_layers:
        weights["layers"] = {n: jnp.zeros((cfg.num_layers, *s), jnp.float32) for n, s in layer_shapes.items()}
    else:
        weights["layers"] = [{n: jnp.zeros(s, jnp.float32) for n, s in layer_shapes.items()}
                             for _ in range(cfg.num_layers)]
    model = LlamaFamilyForCausalLM(cfg, weights)
    return ModelRunner(model, num_blocks=64, block_size=16, max_model_len=2048, max_num_seqs=32,
                       max_num_batched_tokens=256)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[30, 60])
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
    import jax
    jax.config.update("jax_enable_compilation_cache", False)

    from jaxpaged.models.builtin import builtin_model_path
    from jaxpaged.models.config import model_config_from_hf
    from jaxpaged.models.gguf_loader import load_gguf
    from jaxpaged.runner.batch_builder import PREFILL_Q_TILE, BatchShape

    base = model_config_from_hf(load_gguf(builtin_model_path())[0])
    shapes = {"decode 32 seqs": BatchShape(32, 32, 32, 1), "prompt 256 tokens": BatchShape(256, 32, 32, PREFILL_Q_TILE)}
    print(f"{'layers':>6}  {'loop':<9}" + "".join(f"{name:>20}" for name in shapes) + "   (compile s)", flush=True)
    for depth in args.depths:
        cfg = dataclasses.replace(base, num_layers=depth, sliding_windows=(0,) * depth)
        for scan_layers in (True, False):
            runner = _runner(cfg, scan_layers)
            times = []
            for shape in shapes.values():
                start = time.perf_counter()
                runner.compile_step(shape)
                times.append(time.perf_counter() - start)
            print(f"{depth:>6}  {'scan' if scan_layers else 'unrolled':<9}" + "".join(f"{t:>20.1f}" for t in times),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
