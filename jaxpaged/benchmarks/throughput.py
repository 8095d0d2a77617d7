"""Offline throughput: jaxpaged against transformers' `generate` on the same weights and workload.

Workload (ShareGPT-shaped, outputs about twice the prompts): 32 requests, prompts of 8-128
random tokens, outputs of 32-256 tokens, ignore_eos, greedy. transformers runs static
batches of 8, left padded; each batch generates up to its longest output, and only the
requested tokens count as useful output.

    python -m jaxpaged.benchmarks.throughput [--dtype float32|bfloat16] [--skip-hf] [-tp N] [-dp N]

Speculative decoding (`--speculative-config JSON`): the same engine with and without it, same run
and same workload (no transformers): `--workload random` (the above) or `--workload repeat`
(chat prompts asking the built-in model to repeat a passage of tests/data/english_text.txt, the
repetition-heavy case prompt lookup is for; outputs stop at EOS, up to the passage's length + 32).
Greedy outputs must match token for token; acceptance rates are reported.

With -tp/-dp the engine runs sharded over N devices / as N replicas (on CPU, give it devices
with XLA_FLAGS=--xla_force_host_platform_device_count=8); the step clock then times replica 0.
"""

import argparse
import time

import numpy as np


def make_workload(num_requests: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    work = []
    for _ in range(num_requests):
        prompt_len = int(rng.integers(8, 129))
        output_len = int(np.clip(2 * prompt_len + rng.integers(-16, 17), 32, 256))
        work.append((rng.integers(100, vocab - 100, prompt_len).tolist(), output_len))
    return work


def make_repeat_workload(num_requests: int, tokenizer, seed: int = 0) -> list[tuple[list[int], int]]:
    """Chat prompts "Repeat this text exactly" over 2-5 consecutive sentences of the English text."""
    import os
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "english_text.txt")
    with open(path) as f:
        sentences = re.split(r"(?<=[.!?])\s+", " ".join(f.read().split()))
    rng = np.random.default_rng(seed)
    work = []
    for _ in range(num_requests):
        start = int(rng.integers(0, len(sentences) - 5))
        passage = " ".join(sentences[start:start + int(rng.integers(2, 6))])
        messages = [{"role": "user", "content": f"Repeat the following text exactly, with nothing else:\n\n{passage}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        work.append((ids, len(tokenizer.encode(passage)) + 32))
    return work


def run_speculative(work, spec_config: str, model: str | None, ignore_eos: bool, temperature: float = 0.0,
                    **overrides) -> list[str]:
    """The default engine without and with `spec_config` on `work` (each started apart, start-up not
    timed); returns the report's lines."""
    import json

    from jaxpaged import LLM, SamplingParams

    lines, results = [], []
    for spec in (None, json.loads(spec_config)):
        start = time.perf_counter()
        llm = LLM(model, use_tqdm=False, speculative_config=spec, **overrides)
        startup = time.perf_counter() - start
        prompts = [{"prompt_token_ids": p} for p, _ in work]
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=ignore_eos, seed=i)
                  for i, (_, n) in enumerate(work)]
        clock = StepClock(llm.llm_engine.runner)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outputs]
        results.append((elapsed, tokens, llm.get_metrics()))
        lines.append(f"{'speculative ' + json.dumps(spec) if spec else 'no speculation':60s} {elapsed:8.1f} s "
                     f"{sum(map(len, tokens)) / elapsed:10.1f} out tok/s  (start-up {startup:.1f} s; "
                     f"{clock.summary(elapsed)})")
        del llm
    (base_s, base_tokens, _), (spec_s, spec_tokens, m) = results
    drafts = m["jaxpaged:spec_decode_num_draft_tokens_total"]
    accepted = m["jaxpaged:spec_decode_num_accepted_tokens_total"]
    per_pos = [m[k] for k in sorted(k for k in m if "per_pos" in k)]
    base_rate, spec_rate = (sum(map(len, t)) / s for s, t in ((base_s, base_tokens), (spec_s, spec_tokens)))
    same = base_tokens == spec_tokens if temperature == 0 else "n/a (sampled)"
    lines.append(f"speed-up (output tok/s): {spec_rate / base_rate:.2f}x; greedy outputs identical: {same}")
    lines.append(f"verifications {m['jaxpaged:spec_decode_num_drafts_total']}, draft tokens {drafts}, accepted "
                 f"{accepted} ({accepted / max(drafts, 1):.0%}); accepted per position {per_pos}")
    return lines


def matmul_gflops(dtype: str) -> float:
    """This machine's dense matmul throughput in the same process (for context)."""
    import jax
    import jax.numpy as jnp

    n = 1024
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        a = f(a)
    a.block_until_ready()
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


class StepClock:
    """Splits the engine's wall time per step into time blocked on the device (the fetch of a
    step's tokens) and the rest (host: scheduling, input building, dispatch, output processing)."""

    def __init__(self, runner):
        self.steps, self.fetch_s = 0, 0.0
        dispatch, fetch = runner.dispatch, runner.fetch
        self.originals = (dispatch, fetch)   # to undo the wrapping

        def counted_dispatch(*args, **kwargs):
            self.steps += 1
            return dispatch(*args, **kwargs)

        def timed_fetch(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fetch(*args, **kwargs)
            finally:
                self.fetch_s += time.perf_counter() - start

        runner.dispatch, runner.fetch = counted_dispatch, timed_fetch

    def summary(self, elapsed: float) -> str:
        steps = max(self.steps, 1)
        return (f"{self.steps} steps: {1e3 * elapsed / steps:.1f} ms/step, of which waiting on the device "
                f"{1e3 * self.fetch_s / steps:.1f} ms, host {1e3 * (elapsed - self.fetch_s) / steps:.1f} ms")


def run_jaxpaged(work, dtype: str, model: str | None = None, quantization: str | None = None,
                 **parallel) -> tuple[float, int, int, object, str]:
    """Default engine arguments (but the parallel layout), no warm-up on the workload: what a user gets.
    `quantization=None` (not the default "auto", which keeps the built-in GGUF's blocks quantized):
    the same fp32 weights transformers runs."""
    from jaxpaged import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, quantization=quantization, use_tqdm=False, **parallel)
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    clock = StepClock(llm.llm_engine.replicas()[0].runner)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert out_tokens == sum(n for _, n in work)
    info = f"start-up {startup:.1f} s (not timed below); {clock.summary(elapsed)}"
    return elapsed, out_tokens, sum(len(p) for p, _ in work), llm.llm_engine.model_config, info


def builtin_hf_model(dtype: str = "float32", model: str | None = None):
    """transformers' own model on the same weights jaxpaged runs: the built-in GGUF, or `model`
    (a folder or a .gguf)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged.models.builtin import builtin_model_path

    path = model or builtin_model_path()
    if path.endswith(".gguf"):
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=getattr(torch, dtype))
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return hf.eval()


def load_gguf_as_transformers(path: str, dtype: str = "float32"):
    """transformers' own model class on this file's de-quantized tensors (`load_gguf`'s): the model
    `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)` builds, in ~3 s against ~13 s for the
    built-in model on a CPU (transformers' GGUF reader parses the tokenizer's string arrays, twice).
    tests/models/test_gguf compares these tensors and config with transformers' own. Needs torch (a
    baseline's, as every transformers model here: the engine never imports it)."""
    import torch
    import transformers

    from jaxpaged.models.gguf_loader import load_gguf

    config, tensors = load_gguf(path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict({name: torch.from_numpy(t) for name, t in tensors.items()},
                                                strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:   # a tied LM head is the embedding itself
        raise ValueError(f"{path!r}: tensors transformers' {type(model).__name__} does not take: "
                         f"missing={missing}, unexpected={unexpected}")
    return model.eval()


def vocab_size(model: str | None) -> int:
    if model is None:
        return 49152   # the built-in SmolLM2
    if model.endswith(".gguf"):
        from jaxpaged.models.gguf_loader import load_gguf
        return load_gguf(model)[0].vocab_size
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model).vocab_size


def run_transformers(work, dtype: str, batch_size: int = 8, model: str | None = None) -> tuple[float, int]:
    import torch

    model = builtin_hf_model(dtype, model)
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        steps = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, pad_token_id=0)
        useful += sum(n for _, n in batch)
    return time.perf_counter() - start, useful


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true", help="only run jaxpaged")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parser.add_argument("--model", default=None, help="a folder or .gguf (default: the built-in SmolLM2, 9 heads: "
                                                     "tensor parallel sizes 1 and 3)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine override (tests); the README's "
                                                                       "figures use the default")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="likewise")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="compare the engine without and with this speculative_config (no transformers)")
    parser.add_argument("--workload", default="random", choices=["random", "repeat"],
                        help="random tokens (default) or repeat-this-text chat prompts (built-in model)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="with --speculative-config: sample at this temperature (seeded) instead of greedy")
    ns = parser.parse_args(argv)
    overrides = {k: v for k, v in (("max_num_seqs", ns.max_num_seqs),
                                   ("max_num_batched_tokens", ns.max_num_batched_tokens)) if v is not None}
    if ns.speculative_config is not None:
        if ns.workload == "repeat":
            from jaxpaged.models.builtin import builtin_model_path
            from jaxpaged.models.gguf_loader import load_gguf_tokenizer
            work = make_repeat_workload(ns.num_requests, load_gguf_tokenizer(ns.model or builtin_model_path()))
        else:
            work = make_workload(ns.num_requests, vocab_size(ns.model))
        print(f"workload: {ns.workload}, {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
              f"max_tokens {sum(n for _, n in work)}; default engine arguments"
              f"{' but ' + str(overrides) if overrides else ''}")
        for line in run_speculative(work, ns.speculative_config, ns.model, ns.workload == "random", ns.temperature,
                                    **overrides):
            print(line)
        return 0
    work = make_workload(ns.num_requests, vocab_size(ns.model))
    ours_s, out_tokens, prompt_tokens, cfg, info = run_jaxpaged(
        work, ns.dtype, ns.model, tensor_parallel_size=ns.tensor_parallel_size,
        data_parallel_size=ns.data_parallel_size, **overrides)
    flops_per_token = 2 * cfg.num_params()
    peak = matmul_gflops(ns.dtype)
    rows = [("jaxpaged", ours_s, out_tokens)]
    if not ns.skip_hf:
        hf_s, hf_tokens = run_transformers(work, "float32", model=ns.model)
        rows.append(("transformers (fp32, batches of 8)", hf_s, hf_tokens))
    print(f"workload: {len(work)} requests, {prompt_tokens} prompt tokens, {out_tokens} output tokens; "
          f"jaxpaged dtype {ns.dtype}, default engine arguments{' but ' + str(overrides) if overrides else ''}, "
          f"tensor_parallel_size {ns.tensor_parallel_size}, data_parallel_size {ns.data_parallel_size}")
    print(f"jaxpaged: {info}")
    print(f"{'engine':36s} {'time s':>8s} {'out tok/s':>10s} {'useful GFLOP/s':>15s}")
    for name, secs, tokens in rows:
        gflops = flops_per_token * (prompt_tokens + tokens) / secs / 1e9
        print(f"{name:36s} {secs:8.1f} {tokens / secs:10.1f} {gflops:15.1f}")
    if len(rows) == 2:
        print(f"speed-up (output tok/s): {rows[1][1] / rows[0][1]:.2f}x")
    print(f"this machine's {ns.dtype} matmul (1024^3, jax): {peak:.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
