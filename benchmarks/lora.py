"""What multi-LoRA costs: offline throughput of the built-in model with 4 adapters mixed in one batch
against the base model alone, in the same run.

    python -m benchmarks.lora [--num-prompts 32] [--max-tokens 64] [--rank 16]

Three runs of the same prompts, each engine at default arguments plus the LoRA ones: a plain
engine (no enable_lora: what a user without adapters gets), the LoRA engine with every request on
the base model, and the LoRA engine with the requests spread over 4 random rank-`rank` adapters
on all seven projections (PEFT folders written here). Reported: output tokens/s of each and the
mixed run's slowdown against the plain engine. Each engine first runs the prompts once (its
first-touch costs stay out of the timed runs; the prefix cache is emptied before each).
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: str, cfg, rank: int, seed: int) -> str:
    """A random PEFT LoRA folder for a model of ModelConfig `cfg` (all seven projections)."""
    from safetensors.numpy import save_file

    from jaxpaged.lora.peft import module_sizes
    rng = np.random.default_rng(seed)
    sizes = module_sizes(cfg)
    tensors = {}
    for i in range(cfg.num_layers):
        for name, parent in MODULES.items():
            n_in, n_out = sizes[name.removesuffix("_proj")]
            prefix = f"base_model.model.model.layers.{i}.{parent}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (n_out, rank)).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}, f)
    return folder


def timed(llm, prompts, params, loras) -> tuple[float, int]:
    llm.reset_prefix_cache()   # every timed run computes its prompts (no hits from the run before)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    ns = parser.parse_args(argv)

    from jaxpaged import LLM, LoRARequest, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, int(n)).tolist()}
               for n in rng.integers(16, 200, ns.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    results = {}
    plain = LLM(None, use_tqdm=False)
    timed(plain, prompts, params, None)
    results["plain engine, base model"] = timed(plain, prompts, params, None)
    cfg = plain.llm_engine.model_config
    del plain
    root = tempfile.mkdtemp(prefix="jaxpaged-bench-lora-")
    loras = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(root, f"a{i}"), cfg, ns.rank, i))
             for i in range(ns.num_adapters)]
    llm = LLM(None, enable_lora=True, max_loras=ns.num_adapters, max_lora_rank=ns.rank, use_tqdm=False)
    mixed = [loras[i % len(loras)] for i in range(len(prompts))]
    timed(llm, prompts, params, mixed)
    results["LoRA engine, base model"] = timed(llm, prompts, params, None)
    results[f"LoRA engine, {ns.num_adapters} adapters mixed"] = timed(llm, prompts, params, mixed)
    base = results["plain engine, base model"]
    for name, (seconds, tokens) in results.items():
        rate = tokens / seconds
        print(f"{name:36s} {tokens:6d} tokens in {seconds:6.2f} s = {rate:7.1f} tok/s "
              f"({rate / (base[1] / base[0]):.2f}x the plain engine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
