"""Where a decode step's time goes on the GPU (diagnostic for the GPU check's step rows).

    python scripts/gpu_step_profile.py [--dry-run] [--out DIR]

Builds the check's random Qwen2.5-0.5B checkpoint, then for each engine configuration
(compile_on_startup=False: only the shapes used compile) runs greedy decodes of N sequences and
prints per step, as medians over the decode-only steps:
  async ms/step  the engine as users run it ((t(long) - t(short)) / steps, two runs)
  forward ms     the forward executable, blocked on (device time + launch)
  sampler ms     the sampler executable, blocked on
  dispatch host  runner.dispatch's wall time less the blocked waits inside it (Python + transfers)
  fetch ms       runner.fetch (device->host copy and unpack)
  engine host    engine.step's wall less dispatch and fetch (scheduler, outputs)
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/step_profile")
    ns = parser.parse_args()
    os.makedirs(ns.out, exist_ok=True)

    from jaxpaged.bench.gpu_check import engine as check_engine
    from jaxpaged.bench.gpu_check.common import Context

    ctx = Context(dry_run=ns.dry_run, workdir=tempfile.mkdtemp(prefix="step-profile-"))
    for row in check_engine.random_checkpoint(ctx):
        print(row, flush=True)
    path = os.path.join(ctx.workdir, check_engine.MODEL_FOLDER)
    vocab = ctx.sizes.model["vocab_size"]

    seqs = (2, 4) if ns.dry_run else (32, 256)
    configs = [
        ("pallas, defaults", dict(attention_backend="pallas")),
        ("pallas, whole pool", dict(attention_backend="pallas", kv_cache_memory_bytes=None)),
        ("pallas, max_model_len 2048", dict(attention_backend="pallas", max_model_len=2048)),
        ("triton, defaults", dict(attention_backend="triton")),
        ("reference, max_model_len 2048", dict(attention_backend="reference", max_model_len=2048)),
    ]
    only = os.environ.get("PROFILE_CONFIGS")
    if only:
        configs = [configs[int(i)] for i in only.split(",")]
    results = []
    for name, extra in configs:
        try:
            results += profile_config(path, vocab, name, extra, seqs, ns.dry_run)
        except Exception as exc:   # one configuration failing leaves the others
            print(f"[{name}] failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            results.append({"config": name, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
        with open(os.path.join(ns.out, "step_profile.json"), "w") as f:
            json.dump(results, f, indent=1)
    print("\n| config | seqs | async ms/step | forward ms | sampler ms | dispatch host ms | fetch ms | engine host ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | error: {r['error'][:120]} |")
            continue
        print(f"| {r['config']} | {r['seqs']} | {r['async_ms']:.2f} | {r['forward_ms']:.2f} | {r['sampler_ms']:.2f} | "
              f"{r['dispatch_host_ms']:.2f} | {r['fetch_ms']:.2f} | {r['engine_host_ms']:.2f} |")


def profile_config(path, vocab, name, extra, seqs, dry_run):
    import jax

    from jaxpaged import LLM, SamplingParams

    start = time.perf_counter()
    extra = {"kv_cache_memory_bytes": (1 if dry_run else 16) << 30, **extra}
    llm = LLM(path, compile_on_startup=False, **extra)
    print(f"[{name}] LLM() in {time.perf_counter() - start:.1f} s", flush=True)
    engine = llm.llm_engine
    runner = engine.runner
    rng = np.random.default_rng(0)
    short, long = (4, 12) if dry_run else (16, 64)
    out = []
    for num_seqs in seqs:
        def run(max_tokens):
            prompts = [{"prompt_token_ids": rng.integers(0, vocab, 64).tolist()} for _ in range(num_seqs)]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t0

        run(short)
        run(long)   # compiles and loads whatever the timed runs use
        repeats = [1e3 * (run(long) - run(short)) / (long - short) for _ in range(3)]
        print(f"[{name}] {num_seqs} seqs async ms/step, three times: {repeats}", flush=True)
        async_ms = statistics.median(repeats)

        # blocked breakdown
        record = []
        orig_forward, orig_sample, orig_dispatch, orig_fetch = (runner.run_forward, runner.sample, runner.dispatch,
                                                                runner.fetch)
        orig_step = engine.step
        cur = {}

        def run_forward(shape, buffer, prev_tokens):
            t0 = time.perf_counter()
            result = orig_forward(shape, buffer, prev_tokens)
            jax.block_until_ready(result)
            jax.block_until_ready(runner.kv_pool)
            cur["forward"] = cur.get("forward", 0.0) + time.perf_counter() - t0
            cur["shape"] = (shape.num_tokens, shape.num_seqs, shape.num_logits)
            return result

        def sample(pending):
            t0 = time.perf_counter()
            was = pending.is_sampled
            orig_sample(pending)
            if not was:
                jax.block_until_ready(pending.tokens)
                cur["sampler"] = cur.get("sampler", 0.0) + time.perf_counter() - t0

        def dispatch(plan, prev=None):
            t0 = time.perf_counter()
            result = orig_dispatch(plan, prev)
            cur["dispatch"] = cur.get("dispatch", 0.0) + time.perf_counter() - t0
            return result

        def fetch(pending):
            t0 = time.perf_counter()
            result = orig_fetch(pending)
            cur["fetch"] = cur.get("fetch", 0.0) + time.perf_counter() - t0
            return result

        def step():
            cur.clear()
            t0 = time.perf_counter()
            outputs = orig_step()
            cur["step"] = time.perf_counter() - t0
            record.append(dict(cur))
            return outputs

        runner.run_forward, runner.sample, runner.dispatch, runner.fetch = run_forward, sample, dispatch, fetch
        engine.step = step
        try:
            run(long)
        finally:
            runner.run_forward, runner.sample, runner.dispatch, runner.fetch = (orig_forward, orig_sample,
                                                                                orig_dispatch, orig_fetch)
            del engine.step
        shapes = [r["shape"] for r in record if "shape" in r]
        common = max(set(shapes), key=shapes.count)
        decode = [r for r in record if r.get("shape") == common and "sampler" in r and "fetch" in r]

        def med(key, f=lambda r, k: r.get(k, 0.0)):
            return 1e3 * statistics.median(f(r, key) for r in decode)

        row = {"config": name, "seqs": num_seqs, "shape": common, "steps": len(decode), "async_ms": async_ms,
               "forward_ms": med("forward"), "sampler_ms": med("sampler"),
               "dispatch_host_ms": med("dispatch", lambda r, k: r[k] - r["forward"] - r["sampler"]),
               "fetch_ms": med("fetch"),
               "engine_host_ms": med("step", lambda r, k: r[k] - r["dispatch"] - r["fetch"])}
        print(f"[{name}] {row}", flush=True)
        out.append(row)
    llm.shutdown()
    del llm, engine, runner
    import gc
    gc.collect()
    return out


if __name__ == "__main__":
    main()
