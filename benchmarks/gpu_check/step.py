"""The step part: start-up with the default engine arguments, nothing compiled after
it, and the decode step's time against the bytes it has to read.

    start-up        LLM(model) with default arguments and a cold compilation cache: seconds,
                    step variants compiled (every one of warmup_shapes() must be)
    compiles after  XLA compilations while a mixed workload runs twice (greedy, temperature +
                    top_p + seed, logprobs, presence penalty, n=2, prompts from 1 token to past
                    the step's token budget; the second time from the prefix cache): must be 0
    decode N seqs   ms per decode step of N sequences = (t(long) - t(short)) / (long - short),
                    which cancels the prefill; floor = (weight bytes + live KV bytes at the mean
                    context) / the copy part's bandwidth
    ... tp T        with more than one GPU, start-up and decode again with tensor_parallel_size T
                    (the largest power of two the GPUs and the model's heads allow; floor per device)

Only the engine's public face is used (LLM, SamplingParams, llm.llm_engine's runner._compiled,
_samplers and warmup_shapes()), so that the check survives changes inside the runner.
"""

import contextlib
import functools
import logging
import os
import time
from typing import Iterator

import numpy as np

from benchmarks.gpu_check.common import Context, Row, Sizes, guarded
from benchmarks.gpu_check.engine import CHECKPOINT_DTYPE, MODEL_FOLDER

# JAX's monitoring event for one XLA compilation (a persistent-cache hit sends it too: it still
# builds an executable); tests/engine/test_no_compiles_after_startup.py counts the same event.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILE_CACHE_FOLDER = "step_compile_cache"   # under the work dir: empty, so the start-up is cold


@contextlib.contextmanager
def compilations():
    """Yields a list collecting (function name, seconds) of each XLA compilation inside the block."""
    import jax

    compiled = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiled.append((kwargs.get("fun_name", "?"), duration))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def step_check(ctx: Context) -> Iterator[Row]:
    """Start-up, compilations after it, decode step time vs the bytes floor (rows as each is known).

    Estimated on an H200: imports ~10 s; start-up 90-120 s (the KV sizing
    compiles the largest bucket, `auto` times pallas against triton, then 15 step variants compile
    on one thread per core, each with XLA's gemm autotuning; on a 2-core CPU a tiny model's step
    compiles for ~10 s); the mixed workload twice ~5 s; decode runs ~10 s (three generates per N,
    the longest 256 x 80 tokens at a few ms per step). About 150 s of the part's 200 s limit.
    """
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("jaxpaged").setLevel(logging.INFO)   # the log: KV size, auto's pick, compile time
    # Nothing may touch the device before LLM(): the engine sets the allocator's memory fraction
    # (gpu_memory_utilization) only when JAX has not started, and the compilation cache folder is
    # read at the first compilation.
    os.environ["JAXPAGED_COMPILATION_CACHE"] = os.path.join(ctx.workdir, _COMPILE_CACHE_FOLDER)
    from jaxpaged import LLM

    sizes = ctx.sizes
    path = os.path.join(ctx.workdir, MODEL_FOLDER)
    if not os.path.exists(os.path.join(path, "config.json")):
        yield Row("step", "start-up", "error", note=f"no model in {path}: see the checkpoint part")
        return
    with compilations() as startup_compiles:
        start = time.perf_counter()
        llm = LLM(path, **sizes.step_engine_args)
        startup = time.perf_counter() - start
    startup_memory = _allocator_stats()
    yield guarded("step", "start-up", functools.partial(_startup_row, llm, startup, startup_compiles,
                                                        sizes.step_engine_args))

    yield guarded("step", "memory after start-up",
                  functools.partial(_memory_row, "memory after start-up", startup_memory))
    yield guarded("step", "compiles after start-up", functools.partial(_workload_row, llm, sizes))
    yield guarded("step", "memory after the workload", functools.partial(_memory_row, "memory after the workload"))
    copy = [r.data["gbps"] for r in ctx.rows_of("copy") if "gbps" in r.data]
    weight_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    for num_seqs in sizes.step_decode_seqs:
        yield guarded("step", f"decode {num_seqs} seqs", functools.partial(
            _decode_row, llm, sizes, num_seqs, weight_bytes, copy[0] if copy else None))
    busiest = max(sizes.step_decode_seqs)
    yield guarded("step", f"device busy {busiest} seqs", functools.partial(_busy_row, llm, sizes, busiest))
    tp = _tensor_parallel_size(llm)
    if tp > 1:   # the tensor-parallel path, on more than one GPU
        import gc

        import jax
        del llm
        gc.collect()
        jax.clear_caches()
        args = {**sizes.step_engine_args, "tensor_parallel_size": tp}
        holder = {}

        def start_tp() -> Row:
            with compilations() as startup_compiles:
                start = time.perf_counter()
                holder["llm"] = LLM(path, **args)
                startup = time.perf_counter() - start
            return _startup_row(holder["llm"], startup, startup_compiles, args)
        yield guarded("step", f"start-up tp {tp}", start_tp)
        if "llm" in holder:
            for num_seqs in sizes.step_decode_seqs:
                yield guarded("step", f"decode {num_seqs} seqs tp {tp}", functools.partial(
                    _decode_row, holder["llm"], sizes, num_seqs, weight_bytes // tp, copy[0] if copy else None))


def _allocator_stats() -> dict:
    import jax

    return jax.devices()[0].memory_stats() or {}


def _memory_row(case: str, stats: dict | None = None) -> Row:
    """The GPU allocator's statistics: on an H200 the first step can run out of memory with the
    pool sized to leave the analysed step reserve free (engine/memory.py); these say where it went."""
    stats = _allocator_stats() if stats is None else stats
    if not stats:
        return Row("step", case, "skip", note="no allocator statistics on this device (a GPU reports them)")
    gib = {"in use": "bytes_in_use", "peak": "peak_bytes_in_use", "limit": "bytes_limit",
           "largest free block": "largest_free_block_bytes", "largest alloc": "largest_alloc_size"}
    metrics = {f"{name} GiB": stats[key] / (1 << 30) for name, key in gib.items() if key in stats}
    if "bytes_limit" in stats and "bytes_in_use" in stats:
        metrics["free GiB"] = (stats["bytes_limit"] - stats["bytes_in_use"]) / (1 << 30)
    if "num_allocs" in stats:
        metrics["allocations"] = stats["num_allocs"]
    return Row("step", case, "ok", metrics, note="jax.devices()[0].memory_stats()", data={"stats": stats})


def _tensor_parallel_size(llm) -> int:
    """The largest power of two up to the device count that the model can be split by (1: none)."""
    import jax

    from jaxpaged.parallel import check_tensor_parallel
    cfg = llm.llm_engine.model_config
    best, tp = 1, 2
    while tp <= jax.device_count():
        try:
            check_tensor_parallel(cfg, tp)
            best = tp
        except ValueError:
            pass
        tp *= 2
    return best


def _startup_row(llm, seconds: float, compiled: list, engine_args: dict, case: str = "start-up") -> Row:
    engine = llm.llm_engine
    shapes = engine.runner.warmup_shapes()
    missing = [shape for shape in shapes if shape not in engine.runner._compiled]
    args = engine.args
    loaded = getattr(engine, "loaded", None)
    backend = getattr(getattr(loaded, "model", None), "attention_backend", "?")
    given = ", ".join(f"{k} {v}" for k, v in engine_args.items())
    return Row("step", case, "fail" if missing else "ok",
               {"s": seconds, "step variants": len(engine.runner._compiled),
                "sampler variants": len(engine.runner._samplers), "not compiled": len(missing),
                "XLA compiles": len(compiled), "compile s (sum)": sum(d for _, d in compiled), "backend": backend,
                "max_num_seqs": args.max_num_seqs, "batched tokens": args.batched_tokens(engine.max_model_len),
                "max_model_len": engine.max_model_len, "KV blocks": engine.num_blocks},
               note=f"engine arguments: {given + ' (others default)' if given else 'defaults'}; max_model_len "
                    "the model's; cold compilation cache" + (f"; not compiled: {missing[:4]}" if missing else ""),
               data={"compiled": compiled})


def _workload_prompts(rng, lengths, vocab_size: int) -> list[dict]:
    return [{"prompt_token_ids": rng.integers(10, vocab_size - 10, n).tolist()} for n in lengths]


def _workload_row(llm, sizes: Sizes) -> Row:
    """Every sampling feature over prompts of many lengths, twice (the second
    time the prompts come from the prefix cache, so the steps take other shapes), counting XLA
    compilations."""
    from jaxpaged import SamplingParams

    common = dict(max_tokens=sizes.step_workload_tokens, ignore_eos=True, detokenize=False)
    kinds = [SamplingParams(temperature=0.0, **common),
             SamplingParams(temperature=0.8, top_p=0.9, seed=1, **common),
             SamplingParams(temperature=0.0, logprobs=5, **common),
             SamplingParams(temperature=0.7, presence_penalty=0.5, **common),
             SamplingParams(n=2, temperature=0.9, seed=2, **common)]
    prompts = _workload_prompts(np.random.default_rng(1), sizes.step_workload_lens, sizes.model["vocab_size"])
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    requests = tokens = 0
    with compilations() as compiled:
        start = time.perf_counter()
        for _ in range(2):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            requests += len(outputs)
            tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        seconds = time.perf_counter() - start
    if compiled:
        note = f"compiled: {', '.join(sorted({name for name, _ in compiled}))}"
    else:
        note = ("mixed workload twice: greedy, temperature+top_p+seed, logprobs=5, presence_penalty, n=2; "
                f"prompts of {'/'.join(map(str, sizes.step_workload_lens))} tokens")
    return Row("step", "compiles after start-up", "fail" if compiled else "ok",
               {"XLA compiles": len(compiled), "requests": requests, "tokens out": tokens, "s": seconds},
               note=note, data={"compiled": compiled})


def _decode_row(llm, sizes: Sizes, num_seqs: int, weight_bytes: int, copy_gbps: float | None,
                model: dict | None = None, case: str = "") -> Row:
    """Time one decode step of num_seqs sequences as the difference of two greedy runs (of `model`'s
    shape: the check's Qwen2.5-0.5B unless given)."""
    m = model or sizes.model
    import jax.numpy as jnp

    from jaxpaged import SamplingParams

    short, long = sizes.step_max_tokens
    length = sizes.step_prompt_len
    rng = np.random.default_rng(num_seqs)

    def run(max_tokens: int) -> float:
        # fresh random tokens each run: no prefix-cache hits, so every run prefills alike
        prompts = _workload_prompts(rng, [length] * num_seqs, m["vocab_size"])
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        got = {len(o.outputs[0].token_ids) for o in outputs}
        if got != {max_tokens}:
            raise RuntimeError(f"asked for {max_tokens} tokens with ignore_eos, got {sorted(got)}")
        return seconds

    with compilations() as compiled:
        run(short)   # untimed: the first run of each executable may load it
        t_short, t_long = run(short), run(long)
    step_s = (t_long - t_short) / (long - short)
    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_attention_heads"]
    itemsize = jnp.dtype(CHECKPOINT_DTYPE).itemsize
    kv_per_token = 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * head_dim * itemsize   # K and V
    mean_context = length + (short + long) / 2   # over the steps between the two runs' ends
    kv_bytes = num_seqs * mean_context * kv_per_token
    metrics = {"ms/step": step_s * 1e3, "tok/s": num_seqs / step_s if step_s > 0 else 0.0}
    note = f"prompts of {length} tokens; (t({long}) - t({short})) / {long - short} steps"
    if copy_gbps:
        floor_s = (weight_bytes + kv_bytes) / (copy_gbps * 1e9)
        metrics.update({"floor ms": floor_s * 1e3, "x floor": step_s / floor_s})
        note += f"; floor = (weights + KV at mean context {mean_context:.0f}) / copy {copy_gbps:.0f} GB/s"
    else:
        note += "; no copy row (run the copy part first): no floor"
    metrics.update({"weights MB": weight_bytes / 1e6, "KV MB": kv_bytes / 1e6, "XLA compiles": len(compiled)})
    if compiled:
        note = f"compiled while timed: {', '.join(sorted({n for n, _ in compiled}))}"
    return Row("step", case or f"decode {num_seqs} seqs", "fail" if compiled else "ok", metrics, note=note,
               data={"seconds": {short: t_short, long: t_long}, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                     "compiled": compiled})


BUSY_GOAL = 0.85   # the goal: the device busy at least this share of a steady decode step's span


def _busy_row(llm, sizes: Sizes, num_seqs: int) -> Row:
    """The share of steady decode steps' span the device spends in kernels: a jax.profiler trace of
    one greedy run of num_seqs sequences, each LLMEngine.step annotated; over the middle steps (all
    decodes), the union of kernel intervals against the span from the first step's start to the last's end."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    from jaxpaged import SamplingParams

    engine = llm.llm_engine
    step = engine.step

    def annotated():
        with jax.profiler.TraceAnnotation("phase:step"):
            return step()
    prompts = _workload_prompts(np.random.default_rng(num_seqs + 1), [sizes.step_prompt_len] * num_seqs,
                                sizes.model["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=sizes.step_max_tokens[1], ignore_eos=True, detokenize=False)
    with tempfile.TemporaryDirectory(prefix="busy-trace-") as folder:
        engine.step = annotated
        try:
            with jax.profiler.trace(folder):
                llm.generate(prompts, params, use_tqdm=False)
        finally:
            del engine.step
        paths = sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))
        share, span_s, steps = device_busy_share(ProfileData.from_file(paths[-1])) if paths else (None, 0.0, 0)
    case = f"device busy {num_seqs} seqs"
    if share is None:
        return Row("step", case, "skip", note="no device kernels in the trace: a GPU trace has them")
    return Row("step", case, "ok", {"busy %": 100 * share, "goal %": 100 * BUSY_GOAL, "meets": share >= BUSY_GOAL,
                                     "steps": steps, "span ms": span_s * 1e3},
               note=f"jax.profiler trace of {num_seqs} x {sizes.step_max_tokens[1]} greedy tokens; kernels' union "
                    "over the middle decode steps' span")


def device_busy_share(data, steps: int = 8) -> tuple[float | None, float, int]:
    """(busy share, span s, steps) over `steps` steps from the middle of a trace's annotated engine steps
    ("phase:step"); the share is None when the trace holds no device kernels."""
    marks, kernels = [], []
    for plane in data.planes:
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            for e in line.events:
                if e.name == "phase:step":
                    marks.append((e.start_ns, e.start_ns + e.duration_ns))
                elif on_device and "Stream" in line.name:
                    kernels.append((e.start_ns, e.start_ns + e.duration_ns))
    marks.sort()
    if not kernels or len(marks) < 3:
        return None, 0.0, 0
    middle = marks[max(1, len(marks) // 2 - steps // 2):][:steps]
    t0, t1 = middle[0][0], middle[-1][1]
    busy, end = 0, t0
    for start, stop in sorted(kernels):
        start, stop = max(start, end, t0), min(stop, t1)
        if stop > start:
            busy += stop - start
            end = stop
    return busy / max(t1 - t0, 1), (t1 - t0) / 1e9, len(middle)


# ---- one graph per forward: the layer loop's variants -------------------------------------------
# XLA's command buffers with the scanned layer loop captured whole (a WHILE thunk in one CUDA graph,
# its iterations unrolled into it) instead of a graph re-recorded and launched per layer
COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true"
LAYER_VARIANTS = {"unrolled": ({"scan_layers": False}, ""), "command-buffers": ({}, COMMAND_BUFFER_FLAGS)}


def layers_check(ctx: Context, variant: str) -> Iterator[Row]:
    """The step part's start-up and decode rows again with another layer loop (LAYER_VARIANTS): the
    step part's own rows (scan over stacked layers, XLA's defaults) are the baseline they are held to
    (`layers_choice`). Runs in a child of its own: XLA reads its flags when the backend starts."""
    engine_args, xla_flags = LAYER_VARIANTS[variant]
    if xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()
    os.environ["JAXPAGED_COMPILATION_CACHE"] = os.path.join(ctx.workdir, f"{_COMPILE_CACHE_FOLDER}-{variant}")
    from jaxpaged import LLM

    sizes = ctx.sizes
    path = os.path.join(ctx.workdir, MODEL_FOLDER)
    if not os.path.exists(os.path.join(path, "config.json")):
        yield Row("layers", f"{variant} start-up", "error", note=f"no model in {path}: see the checkpoint part")
        return
    args = {**sizes.step_engine_args, **engine_args}
    with compilations() as startup_compiles:
        start = time.perf_counter()
        llm = LLM(path, **args)
        startup = time.perf_counter() - start
    row = _startup_row(llm, startup, startup_compiles, args)
    yield Row("layers", f"{variant} start-up", row.status, row.metrics,
              note=f"{variant}{' (XLA_FLAGS ' + xla_flags + ')' if xla_flags else ''}; {row.note}")
    copy = [r.data["gbps"] for r in ctx.rows_of("copy") if "gbps" in r.data]
    weight_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    for num_seqs in sizes.step_decode_seqs:
        def decode(num_seqs=num_seqs) -> Row:
            r = _decode_row(llm, sizes, num_seqs, weight_bytes, copy[0] if copy else None)
            return Row("layers", f"{variant} decode {num_seqs} seqs", r.status, r.metrics, note=r.note, data=r.data)
        yield guarded("layers", f"{variant} decode {num_seqs} seqs", decode)


def layers_choice(ctx: Context) -> list[Row]:
    """Each variant's start-up and decode ms/step against the scanned loop's (the step part's rows),
    and the variant that decodes fastest at the largest batch (start-up within 60 s)."""
    scan = {r.case: r.metrics for r in ctx.rows_of("step") if r.status == "ok"}
    runs = {r.case: r.metrics for r in ctx.rows_of("layers") if r.status == "ok"}
    if "start-up" not in scan or not runs:
        return [Row("layers", "choice", "skip", note="the step part or no variant ran: nothing to compare")]
    rows, candidates = [], {"scan": (scan["start-up"]["s"], scan.get(f"decode {max(ctx.sizes.step_decode_seqs)} seqs",
                                                                       {}).get("ms/step", float("inf")))}
    for variant in LAYER_VARIANTS:
        if f"{variant} start-up" not in runs:
            continue
        metrics = {"start-up s": runs[f"{variant} start-up"]["s"], "scan start-up s": scan["start-up"]["s"]}
        for n in ctx.sizes.step_decode_seqs:
            mine, base = runs.get(f"{variant} decode {n} seqs"), scan.get(f"decode {n} seqs")
            if mine and base:
                metrics[f"{n} seqs ms"] = mine["ms/step"]
                metrics[f"{n} seqs vs scan"] = mine["ms/step"] / base["ms/step"]
        largest = metrics.get(f"{max(ctx.sizes.step_decode_seqs)} seqs ms", float("inf"))
        candidates[variant] = (metrics["start-up s"], largest)
        rows.append(Row("layers", f"{variant} vs scan", "ok", metrics))
    fit = {k: v for k, v in candidates.items() if v[0] <= 60.0} or candidates
    best = min(fit, key=lambda k: fit[k][1])
    rows.append(Row("layers", "choice", "ok", {"fastest": best, "ms/step": fit[best][1], "start-up s": fit[best][0]},
                    note="decode ms/step at the largest batch among the variants starting within 60 s"))
    return rows
