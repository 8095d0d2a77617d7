"""The GPU check's driver: runs each part in its own child process under a time limit, writes one table.

    python -m benchmarks.gpu_check [--dry-run] [--out DIR] [--budget-s S] [--parts a,b]

A part is a named function Context -> rows. Each runs in a fresh child process, which owns the
GPU while it runs (memory freed between parts), is killed at the part's limit (its rows so far
are kept: a child writes each row as soon as it has it), and cannot take the driver down with
it. The driver itself never touches a device. A whole run stays within --budget-s: a part
gets what is left when its turn comes, and parts with no time left are reported as skipped.
--dry-run takes the same code paths with tiny sizes (kernels in interpret mode on CPU).

To add a part: write `fn(ctx: Context) -> Iterator[Row]` (see common.py) and add it to PARTS.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable

from benchmarks.gpu_check import engine, kernels, large, peer, step, system, vision
from benchmarks.gpu_check.common import STATUSES, Context, Row, error_row

# Candidate jax-triton folders (os.pathsep-separated), tried in order; scripts/gpu_check.sh sets it.
JAX_TRITON_ENV = "GPU_CHECK_JAX_TRITON"
_REPO = pathlib.Path(__file__).resolve().parents[2]
_LOG_TAIL_BYTES = 200_000


@dataclasses.dataclass(frozen=True)
class Part:
    """run(ctx) -> rows in a child process; an in_driver part is run(ctx, limit_s) in the driver
    (it may not touch a device: it combines earlier rows or starts children of its own)."""

    name: str                                  # unique; rows name the part before any ':'
    run: Callable[..., Iterable[Row]]
    limit_s: float                             # wall-clock limit of the part on the GPU machine
    in_driver: bool = False


def select_jax_triton(ctx: Context, limit_s: float) -> list[Row]:
    """Probe each candidate jax-triton folder in a child; later parts put the chosen one first on PYTHONPATH.

    Chosen: the first whose probe passes (import, and on a GPU a Triton kernel), else the first that
    imports (so that the kernel parts still show how the real kernel fails).
    """
    candidates = [p for p in os.environ.get(JAX_TRITON_ENV, "").split(os.pathsep) if p]
    if not candidates:
        return [Row("jax-triton", "select", "skip", note=f"{JAX_TRITON_ENV} unset: the environment's jax-triton")]
    rows, passed, imported = [], "", ""
    deadline = time.monotonic() + limit_s
    for path in candidates:
        remaining = deadline - time.monotonic()
        if remaining < 5:
            break
        got = run_in_child(PROBE, ctx, min(PROBE.limit_s, remaining), pythonpath_first=path)
        for row in got:
            row.case = f"{os.path.basename(path.rstrip('/'))} {row.case}"
        rows += got
        if any(r.case.endswith(" import") and r.status == "ok" for r in got):
            imported = imported or path
        if all(r.status in ("ok", "skip") for r in got) and imported == path:
            passed = path
            break
    chosen = passed or imported
    note = "" if passed else ("the kernel probe failed everywhere: the first importable is used" if chosen
                              else "none imports: the triton backend will fail")
    rows.append(Row("jax-triton", "select", "ok" if passed else "fail", {"chosen": chosen or "none"}, note=note,
                    data={"path": chosen}))
    return rows


PROBE = Part("jax-triton:probe", system.jax_triton_probe, 90)
# Estimated seconds on an H200, against the 450 s budget: jax-triton ~20 (two
# probes), env ~10, kernels ~60, copy ~5, swap ~10, attention ~40, checkpoint ~30, step ~150 (a cold
# start-up compiling 15 variants, see step.py), engine:* ~30 each (a few shapes compiled as they
# come, 64 x 128 tokens): about 420 s. The step part runs before the per-backend engine
# parts: if the budget runs short, the last of those is skipped, not the start-up measurement.
PARTS = (
    Part("jax-triton", select_jax_triton, 150, in_driver=True),
    Part("env", system.environment, 60),
    Part("kernels", kernels.kernel_correctness, 120),
    Part("copy", system.copy_bandwidth, 45),
    Part("swap", system.swap_round_trip, 60),
    Part("attention", kernels.attention_timing, 120),
    Part("attention:prefill", kernels.prefill_attention_timing, 90),
    Part("qmatmul", kernels.quantized_matmul_timing, 100),
    Part("sampler", kernels.sampler_layout_timing, 45),
    Part("checkpoint", engine.random_checkpoint, 120),
    Part("step", step.step_check, 200),
    # one graph per forward: the layer loop unrolled, and the scan captured by command buffers
    Part("layers:unrolled", functools.partial(step.layers_check, variant="unrolled"), 200),
    Part("layers:cmdbuf", functools.partial(step.layers_check, variant="command-buffers"), 200),
    Part("layers:choice", lambda ctx, limit_s: step.layers_choice(ctx), 10, in_driver=True),
    # Llama-3.1-8B's shape (weights drawn on the GPU, load_format="dummy"): decode at 32 sequences vs its floor
    Part("step:8b", large.large_model_check, 240),
    # the same-run peer: transformers' continuous batching against the engine, same weights and workload
    Part("peer:transformers", peer.transformers_run, 240),
    Part("peer:jaxpaged", peer.engine_run, 240),
    Part("peer:ratio", lambda ctx, limit_s: peer.peer_ratio(ctx), 10, in_driver=True),
    Part("tier", engine.tier_reload, 120),   # the host tier: a 4k history reloaded against recomputed
    Part("vision", vision.vision_check, 200),   # Qwen2.5-VL-7B's tower: start-up and ms per image
    Part("engine:pallas", functools.partial(engine.engine_run, backend="pallas"), 90),
    Part("engine:pallas_triton", functools.partial(engine.engine_run, backend="pallas_triton"), 90),
    Part("engine:triton", functools.partial(engine.engine_run, backend="triton"), 90),
    Part("engine:reference", functools.partial(engine.engine_run, backend="reference"), 90),
    Part("engine:agreement", lambda ctx, limit_s: engine.engine_agreement(ctx), 10, in_driver=True),
    Part("spec", engine.speculative_step_cost, 150),   # last: skipped first when time runs short
)
_CHILD_PARTS = {p.name: p for p in (*PARTS, PROBE) if not p.in_driver}


def _family(name: str) -> tuple[str, str]:
    family, _, sub = name.partition(":")
    return family, sub or "(part)"


def _tail(path: str, lines: int = 4, chars: int = 400) -> str:
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-chars:]


def _files(ctx: Context, name: str) -> tuple[str, str, str]:
    stem = os.path.join(ctx.workdir, name.replace(":", "_"))
    return stem + ".context.json", stem + ".rows.jsonl", stem + ".log"


def run_in_child(part: Part, ctx: Context, limit_s: float, pythonpath_first: str = "") -> list[Row]:
    """The part's rows from a child process killed after limit_s; an error/timeout row says what went wrong."""
    context_file, rows_file, log_file = _files(ctx, part.name)
    pathlib.Path(context_file).write_text(ctx.to_json())
    pathlib.Path(rows_file).write_text("")
    env = dict(os.environ, PYTHONUNBUFFERED="1")   # a killed child's last words reach its log
    paths = [pythonpath_first or ctx.jax_triton_path, str(_REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--child", part.name, "--context", context_file,
               "--rows", rows_file]
    with open(log_file, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code, timed_out = child.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)   # its own session: the part and anything it started
            code, timed_out = child.wait(), True
    rows = [Row(**json.loads(line)) for line in pathlib.Path(rows_file).read_text().splitlines() if line.strip()]
    family, case = _family(part.name)
    if timed_out:
        rows.append(Row(family, case, "timeout", note=f"killed after {limit_s:.0f} s; log: {_tail(log_file)}"))
    elif code != 0:
        rows.append(Row(family, case, "error", note=f"child exit code {code}; log: {_tail(log_file)}"))
    elif not rows:
        rows.append(Row(family, case, "error", note=f"no rows; log: {_tail(log_file)}"))
    return rows


def child_main(name: str, context_file: str, rows_file: str) -> int:
    """Inside the child: run one part, appending each row to rows_file as soon as it exists."""
    ctx = Context.from_json(pathlib.Path(context_file).read_text())
    part = _CHILD_PARTS[name]
    with open(rows_file, "a") as out:
        def emit(row: Row) -> None:
            out.write(json.dumps(dataclasses.asdict(row), default=_jsonable) + "\n")
            out.flush()
        try:
            for row in part.run(ctx):
                emit(row)
        except Exception as exc:  # noqa: BLE001 -- the part's own failure is a row, not a crash
            emit(error_row(*_family(name), exc))
    return 0


def _jsonable(value):
    return value.item() if hasattr(value, "item") else str(value)


def run_check(dry_run: bool, budget_s: float, only: set[str] | None = None, workdir: str | None = None,
              out_dir: str | None = None, progress: Callable[[str], None] = functools.partial(print, flush=True),
              ) -> tuple[list[Row], dict]:
    """Every part in order within budget_s seconds; returns (rows, meta).

    With out_dir, the outputs are rewritten after every part: if the whole call is cut short,
    what ran is still there.
    """
    workdir = workdir or tempfile.mkdtemp(prefix="gpu-check-")
    ctx = Context(dry_run=dry_run, workdir=workdir)
    start = time.monotonic()
    deadline = start + budget_s
    meta = {"dry_run": dry_run, "budget_s": budget_s, "commit": _commit(), "workdir": workdir}
    for part in PARTS:
        if only and part.name not in only:
            continue
        remaining = deadline - time.monotonic()
        part_start = time.monotonic()
        if remaining < 5:
            rows = [Row(*_family(part.name), "skip", note=f"no time left in the {budget_s:.0f} s budget")]
        elif part.in_driver:
            try:
                rows = list(part.run(ctx, min(part.limit_s, remaining)))
            except Exception as exc:  # noqa: BLE001
                rows = [error_row(*_family(part.name), exc)]
        else:
            rows = run_in_child(part, ctx, min(part.limit_s, remaining))
        ctx.previous.extend(rows)
        if part.name == "jax-triton":
            ctx.jax_triton_path = next((r.data["path"] for r in rows if r.data.get("path")), "")
        counts = {s: sum(r.status == s for r in rows) for s in STATUSES if any(r.status == s for r in rows)}
        progress(f"[gpu_check] {part.name}: {counts} in {time.monotonic() - part_start:.1f} s")
        meta.update(seconds=round(time.monotonic() - start, 1), jax_triton_path=ctx.jax_triton_path,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        if out_dir:
            write_outputs(ctx.previous, meta, out_dir)
    return ctx.previous, meta


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or os.environ.get("GPU_CHECK_COMMIT", "unknown")
    except (OSError, subprocess.TimeoutExpired):
        return os.environ.get("GPU_CHECK_COMMIT", "unknown")


def format_value(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        size = abs(value)
        if size == 0 or 0.01 <= size < 100:
            return f"{value:.3g}"
        return f"{value:.0f}" if size >= 100 else f"{value:.2e}"
    return str(value)


def render_table(rows: list[Row], meta: dict) -> str:
    def cell(text: str, limit: int = 200) -> str:
        text = " ".join(str(text).split()).replace("|", "/")
        return text if len(text) <= limit else text[:limit - 3] + "..."

    mode = "dry run (CPU, tiny sizes)" if meta["dry_run"] else "GPU"
    lines = [f"GPU check, {mode}: commit {meta['commit']}, {meta['date']}, {meta['seconds']} s",
             "", "| part | case | status | result | note |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        result = ", ".join(f"{k} {format_value(v)}" for k, v in row.metrics.items())
        lines.append(f"| {cell(row.part)} | {cell(row.case)} | {row.status} | {cell(result, 240)} | {cell(row.note)} |")
    counts = ", ".join(f"{sum(r.status == s for r in rows)} {s}" for s in STATUSES)
    lines += ["", f"rows: {counts}"]
    return "\n".join(lines) + "\n"


def write_outputs(rows: list[Row], meta: dict, out_dir: str) -> str:
    """gpu_check.md (the table), gpu_check.json (rows with raw data), gpu_check.log (the parts' logs)."""
    os.makedirs(out_dir, exist_ok=True)
    table = render_table(rows, meta)
    pathlib.Path(out_dir, "gpu_check.md").write_text(table)
    pathlib.Path(out_dir, "gpu_check.json").write_text(
        json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1, default=_jsonable))
    with open(os.path.join(out_dir, "gpu_check.log"), "w") as log:
        for name in sorted(os.listdir(meta["workdir"])):
            if name.endswith(".log"):
                text = pathlib.Path(meta["workdir"], name).read_text(errors="replace")
                log.write(f"===== {name} ({len(text)} chars, last {_LOG_TAIL_BYTES} kept)\n")
                log.write(text[-_LOG_TAIL_BYTES:] + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU is fine (tests the check itself)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="folder for the results")
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget of the whole run")
    parser.add_argument("--parts", default="", help="comma-separated part names (default: all): "
                        + ", ".join(p.name for p in PARTS))
    parser.add_argument("--keep-workdir", action="store_true", help="keep the parts' scratch folder (model, logs)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--context", help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        return child_main(ns.child, ns.context, ns.rows)
    only = {p.strip() for p in ns.parts.split(",") if p.strip()} or None
    unknown = (only or set()) - {p.name for p in PARTS}
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(p.name for p in PARTS)}")
    rows, meta = run_check(ns.dry_run, ns.budget_s, only, out_dir=ns.out)
    table = render_table(rows, meta)
    if not ns.keep_workdir:
        shutil.rmtree(meta["workdir"], ignore_errors=True)
    print(f"[gpu_check] wrote {ns.out}/gpu_check.md, gpu_check.json, gpu_check.log")
    print(table, end="")
    return 0
