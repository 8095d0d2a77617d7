"""Loading a model: a converted orbax folder (`jaxpaged convert`) against safetensors.

The built-in SmolLM2-135M-Instruct is written once as a Hugging Face safetensors folder and once
as a converted folder (both fp32, in a temporary folder); then `load_model` reads each, best of
`--repeats`, in this process, with each tensor-parallel size that fits the devices (on CPU, give
devices with XLA_FLAGS=--xla_force_host_platform_device_count=8).

    python -m benchmarks.load_time [--repeats 3] [--tp 1 3]
"""

import argparse
import json
import os
import tempfile
import time


def write_safetensors_folder(gguf_path: str, out: str) -> str:
    """The GGUF's weights (de-quantized, fp32) as a Hugging Face folder: config, safetensors, tokenizer."""
    import numpy as np
    from safetensors.numpy import save_file

    from jaxpaged.models.gguf_loader import load_gguf, load_gguf_tokenizer

    hf_config, tensors = load_gguf(gguf_path)
    os.makedirs(out, exist_ok=True)
    hf_config.save_pretrained(out)
    save_file({name: np.ascontiguousarray(value, np.float32) for name, value in tensors.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    load_gguf_tokenizer(gguf_path).save_pretrained(out)
    return out


def time_load(path: str, tp: int, repeats: int) -> float:
    import jax

    from jaxpaged.models.loader import load_model
    from jaxpaged.parallel import ShardPlan

    plan = ShardPlan.for_devices(jax.devices()[:tp], pin=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        loaded = load_model(path, "float32", shard_plan=plan)
        from flax import nnx
        jax.block_until_ready(jax.tree.leaves(nnx.state(loaded.model)))
        best = min(best, time.perf_counter() - start)
        del loaded
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3], help="SmolLM2 has 9 heads: tp 1, 3")
    ns = parser.parse_args(argv)
    import jax

    from jaxpaged.models.builtin import builtin_model_path
    from jaxpaged.models.loader import convert_checkpoint

    root = tempfile.mkdtemp(prefix="jaxpaged-load-")
    start = time.perf_counter()
    folder = write_safetensors_folder(builtin_model_path(), os.path.join(root, "safetensors"))
    written = time.perf_counter() - start
    start = time.perf_counter()
    converted = convert_checkpoint(folder, os.path.join(root, "orbax"), "float32")
    converted_s = time.perf_counter() - start
    rows = []
    for tp in ns.tp:
        if tp > jax.device_count():
            print(f"tp {tp}: skipped ({jax.device_count()} devices)")
            continue
        rows.append({"tp": tp, "safetensors_s": time_load(folder, tp, ns.repeats),
                     "orbax_s": time_load(converted, tp, ns.repeats)})
    print(f"built-in model as safetensors in {written:.1f} s; `jaxpaged convert` of it in {converted_s:.1f} s")
    print(f"{'tp':>3} {'safetensors s':>14} {'orbax s':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['tp']:>3} {r['safetensors_s']:14.2f} {r['orbax_s']:8.2f} {r['safetensors_s'] / r['orbax_s']:6.2f}x")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
