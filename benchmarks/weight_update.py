"""What `update_weights` costs: every weight of the built-in model written in place.

    python -m benchmarks.weight_update

The fp32 engine (`quantization=None`) is updated with the checkpoint's own tensors (Hugging Face
names, NumPy arrays, as a trainer would hand them over) three times; reported: seconds per full
update, and the device memory the engine's live arrays take before, after and at most between
two written tensors (each write donates the weight it replaces).
"""

import time


def main() -> int:
    import jax

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.models import weight_update
    from jaxpaged.models.builtin import builtin_model_path
    from jaxpaged.models.gguf_loader import load_gguf

    def device_bytes() -> int:
        return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")

    llm = LLM(None, quantization=None, use_tqdm=False)
    _, tensors = load_gguf(builtin_model_path())
    weights = {name: tensors[name] for name in tensors.keys()}
    prompt = [{"prompt_token_ids": list(range(100, 140))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    before_tokens = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    peak, write = [0], weight_update._write

    def watched(*args):
        out = write(*args)
        peak[0] = max(peak[0], device_bytes())
        return out

    weight_update._write = watched
    before = device_bytes()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        llm.update_weights(weights)
        jax.block_until_ready(jax.live_arrays())
        times.append(time.perf_counter() - start)
    after = device_bytes()
    same = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == before_tokens
    largest = max(v.nbytes for v in weights.values())
    print(f"{len(weights)} tensors, {sum(v.nbytes for v in weights.values()) / 1e6:.1f} MB (fp32); "
          f"update_weights: {', '.join(f'{t:.2f}' for t in times)} s (first includes compiling the writes)")
    print(f"device bytes: before {before / 1e6:.1f} MB, after {after / 1e6:.1f} MB, most between writes "
          f"{peak[0] / 1e6:.1f} MB (+{(peak[0] - before) / 1e6:.1f} MB; largest tensor {largest / 1e6:.1f} MB); "
          f"greedy tokens unchanged: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
