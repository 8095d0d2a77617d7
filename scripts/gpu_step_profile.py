"""Where a decode step's time goes on the GPU (diagnostic for the GPU check's step rows).

    python scripts/gpu_step_profile.py [--dry-run] [--seqs 32,256] [--out DIR]
    PROFILE_CONFIGS=0,1 ...   only those configurations (indices into `configs` below)
    PROFILE_LONG=1 ...        16 and 64 new tokens on a dry run too
    PROFILE_TRACE=1 ...       also a jax.profiler trace of one run per size: the last steps' timeline of host
                              phases and device executables (trace_N.txt, trace_N.xplane.pb in --out)

On a CPU, `PROFILE_CONFIGS=5 PROFILE_LONG=1 ... --dry-run --seqs 256` (a tiny model) shows the host's share.

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


_OUT = ["/tmp/step_profile"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--seqs", default="", help="comma-separated sequence counts (default 32,256; dry run 2,4)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/step_profile")
    ns = parser.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    _OUT[0] = ns.out

    from benchmarks.gpu_check import engine as check_engine
    from benchmarks.gpu_check.common import Context

    with tempfile.TemporaryDirectory(prefix="step-profile-") as workdir:   # the random checkpoint, removed after
        profile_all(ns, Context(dry_run=ns.dry_run, workdir=workdir), check_engine)


def profile_all(ns, ctx, check_engine) -> None:
    for row in check_engine.random_checkpoint(ctx):
        print(row, flush=True)
    path = os.path.join(ctx.workdir, check_engine.MODEL_FOLDER)
    vocab = ctx.sizes.model["vocab_size"]

    seqs = tuple(int(n) for n in ns.seqs.split(",")) if ns.seqs else (2, 4) if ns.dry_run else (32, 256)
    configs = [
        ("pallas, defaults", dict(attention_backend="pallas")),
        ("pallas, whole pool", dict(attention_backend="pallas", kv_cache_memory_bytes=None)),
        ("pallas, max_model_len 2048", dict(attention_backend="pallas", max_model_len=2048)),
        ("triton, defaults", dict(attention_backend="triton")),
        ("reference, max_model_len 2048", dict(attention_backend="reference", max_model_len=2048)),
        ("reference, defaults", dict(attention_backend="reference")),
        ("pallas, unrolled layers", dict(attention_backend="pallas", scan_layers=False)),
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
    short, long = (16, 64) if not dry_run or os.environ.get("PROFILE_LONG") else (4, 12)
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
        if os.environ.get("PROFILE_TRACE"):
            trace_steps(llm, run, name, num_seqs)

        # blocked breakdown
        record = []
        orig_forward, orig_sample, orig_dispatch, orig_fetch = (runner.run_forward, runner.sample, runner.dispatch,
                                                                runner.fetch)
        orig_step = engine.step
        cur = {}

        def run_forward(shape, *args):
            t0 = time.perf_counter()
            result = orig_forward(shape, *args)
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
    llm = engine = runner = None   # the next configuration gets the memory
    import gc
    gc.collect()
    return out


_PHASES = (("engine", "step"), ("scheduler", "schedule"), ("runner", "dispatch"), ("runner", "fetch"),
           ("scheduler", "update_from_output"), ("engine", "_outputs"), ("runner", "run_forward"), ("runner", "sample"))


def trace_steps(llm, run, name, num_seqs, max_tokens=24):
    """jax.profiler.trace of one run (the engine's phases annotated, nothing blocked), then a timeline of
    its last decode steps: host phases and the device's executables, and the device's idle share."""
    import glob

    import jax
    from jax.profiler import ProfileData

    engine = llm.llm_engine
    owners = {"engine": engine, "scheduler": engine.scheduler, "runner": engine.runner}
    saved = []
    for owner, attr in _PHASES:
        obj = owners[owner]
        fn = getattr(obj, attr)

        def wrapped(*args, _fn=fn, _label=f"phase:{attr.strip('_')}", **kwargs):
            with jax.profiler.TraceAnnotation(_label):
                return _fn(*args, **kwargs)
        setattr(obj, attr, wrapped)
        saved.append((obj, attr))
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 2
    out_dir = _OUT[0]
    with tempfile.TemporaryDirectory(prefix="step-trace-") as folder:   # (a small trace is kept in out_dir)
        try:
            with jax.profiler.trace(folder, profiler_options=options):
                run(max_tokens)
        finally:
            for obj, attr in saved:
                delattr(obj, attr)
        path = sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))[-1]
        size = os.path.getsize(path)
        if size < 15 << 20:
            import shutil
            shutil.copy(path, os.path.join(out_dir, f"trace_{num_seqs}.xplane.pb"))
        lines = summarize_trace(ProfileData.from_file(path))
    print(f"[{name}] trace of {num_seqs} seqs x {max_tokens} tokens ({size >> 10} KiB):", flush=True)
    print("\n".join(lines), flush=True)
    with open(os.path.join(out_dir, f"trace_{num_seqs}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def summarize_trace(data, last_steps=6):
    host, device_modules, kernels = [], [], []
    for plane in data.planes:
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            for e in line.events:
                item = (e.start_ns, e.start_ns + e.duration_ns, e.name)
                if e.name.startswith("phase:"):
                    host.append((item[0], item[1], e.name[6:]))
                elif on_device and line.name == "XLA Modules":
                    device_modules.append(item)
                elif on_device and "Stream" in line.name:
                    kernels.append(item)
    out = [f"events: host phases {len(host)}, device modules {len(device_modules)}, kernels {len(kernels)}"]
    steps = sorted(e for e in host if e[2] == "step")
    if not steps:
        return out + ["no step phases found"]
    middle = steps[max(0, len(steps) // 2 - last_steps // 2):][:last_steps]   # decode steps, before the tail
    t0, t1 = middle[0][0], middle[-1][1]
    busy, end = 0, t0
    for start, stop, _ in sorted(kernels):
        start, stop = max(start, end, t0), min(stop, t1)
        if stop > start:
            busy += stop - start
            end = stop
    if kernels:
        out.append(f"last {last_steps} steps: {(t1 - t0) / 1e6:.2f} ms, device kernels busy {busy / 1e6:.2f} ms "
                   f"({100 * busy / max(t1 - t0, 1):.0f}%)")
    def inside(a, b):
        spans = [(x, y) for x, y, _ in kernels if a <= x and y <= b]
        return f" ({len(spans)} kernels, {sum(y - x for x, y in spans) / 1e6:.3f} ms in kernels)"

    window = sorted([(a, b, f"host {n}") for a, b, n in host if t0 <= a <= t1]
                    + [(a, b, f"   device {n}" + inside(a, b)) for a, b, n in device_modules if t0 <= a <= t1])
    for a, b, label in window:
        out.append(f"{(a - t0) / 1e6:9.3f} {(b - t0) / 1e6:9.3f} {(b - a) / 1e6:8.3f}  {label[:120]}")
    return out


if __name__ == "__main__":
    main()
