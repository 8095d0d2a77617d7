"""scripts/gpu_check.sh and its driver (benchmarks/gpu_check), on CPU.

The dry run goes through the script's device path (carried wheels installed offline, jax-triton
candidates probed, no editable install) and takes every part's code with tiny sizes, so a bug in
the check shows up here and not in the one GPU call a task may get.
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

from benchmarks.gpu_check import driver
from benchmarks.gpu_check.common import DRY, Context, Row
from benchmarks.gpu_check.engine import engine_agreement
from benchmarks.gpu_check.step import compilations

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
FAKE = "gpucheckfake"


def write_fake_wheel(folder: pathlib.Path) -> None:
    """A minimal pure-Python wheel, standing in for a carried one (no network here)."""
    folder.mkdir(parents=True)
    info = f"{FAKE}-1.0.dist-info"
    files = {f"{FAKE}/__init__.py": "VALUE = 1\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {FAKE}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{FAKE}-1.0-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def run_script(*args, env_extra: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **(env_extra or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_check")
    write_fake_wheel(root / "wheels" / "common")
    candidate = root / "jax-triton-here"   # empty: the environment's jax-triton is found behind it
    candidate.mkdir()
    run = run_script("--dry-run", timeout=400, env_extra=dict(
        GPU_CHECK_WHEELS=str(root / "wheels"), GPU_CHECK_SITE=str(root / "site"), GPU_CHECK_EDITABLE="0",
        GPU_CHECK_JAX_TRITON=str(candidate), JAX_PLATFORMS="cpu", OUT=str(root / "out")))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((root / "out" / "gpu_check.json").read_text())
    rows = [Row(**r) for r in result["rows"]]
    return run, root, rows


def test_every_part_runs_and_only_gpu_only_backends_are_skipped(dry_run):
    _, _, rows = dry_run
    families = {p.name.partition(":")[0] for p in driver.PARTS}
    assert families <= {r.part for r in rows}
    for name in ("engine:pallas", "engine:reference"):
        assert any(r.part == "engine" and r.case == name.partition(":")[2] and r.status == "ok" for r in rows)
    assert any(r.case.startswith("agreement") and r.status == "ok" for r in rows)
    for row in rows:
        if row.status == "skip":
            assert "GPU" in row.note or row.case == "nvidia-smi", row   # GPU-only work, said so
        else:
            assert row.status == "ok", row


def test_kernel_rows_pass_and_timings_are_measured(dry_run):
    _, _, rows = dry_run
    checked = [r for r in rows if r.part == "kernels" and r.status == "ok"]
    assert {r.case.split()[0] for r in checked} == {"reference", "pallas"}
    assert {r.case.split()[1] for r in checked} >= {"mixed", "decode"}
    assert {r.case.split()[0] for r in checked if "sinks" in r.case} == {"reference", "pallas"}   # gpt-oss's
    assert all(r.metrics["rel err"] <= r.metrics["rel tol"] for r in checked)
    timed = [r for r in rows if r.part == "attention" and r.status == "ok" and "prefill" not in r.case]
    assert timed and all(r.metrics["ms"] > 0 and r.metrics["of read"] > 0 and r.metrics["of copy"] > 0
                         for r in timed)
    prefill = {r.case.split()[0]: r for r in rows if r.part == "attention" and "prefill" in r.case}
    assert prefill["pallas"].status == prefill["reference"].status == "ok", prefill
    assert prefill["pallas_triton"].status == "skip" and prefill["pallas"].metrics["TFLOP/s"] > 0
    swaps = [r for r in rows if r.part == "swap"]
    assert len(swaps) == 2 and all(r.metrics["bit-exact"] is True for r in swaps)
    matmuls = [r for r in rows if r.part == "qmatmul"]   # W8A16 and W4A16 at each row count, against bf16
    assert len(matmuls) == 2 * len(DRY.qmm_rows) and all(r.status == "ok" for r in matmuls), matmuls
    assert all(r.metrics["bf16 ms"] > 0 and r.metrics[f"{kernel} max diff vs dequant"] < 0.05
               for r in matmuls for kernel in ("mosaic", "triton-lowered"))
    layouts = [r for r in rows if r.part == "sampler"]   # both sampler layouts timed, the same greedy tokens
    assert len(layouts) == 2 * len(DRY.sampler_rows) and all(r.status == "ok" for r in layouts), layouts


def test_step_rows_report_start_up_no_compiles_after_it_and_decode_time_against_the_floor(dry_run):
    _, _, rows = dry_run
    step = {r.case: r for r in rows if r.part == "step" and not r.case.startswith("8B")}
    decode = [f"decode {n} seqs" for n in DRY.step_decode_seqs]
    memory = ["memory after start-up", "memory after the workload"]   # the GPU allocator's statistics
    busy = f"device busy {max(DRY.step_decode_seqs)} seqs"               # a GPU trace's kernels
    assert list(step) == ["start-up", memory[0], "compiles after start-up", memory[1], *decode, busy]
    assert all(r.status == "ok" for case, r in step.items() if case not in memory + [busy]), step
    assert all(step[case].status == "skip" for case in memory + [busy])   # a CPU has no allocator statistics
    startup = step["start-up"].metrics
    assert startup["s"] > 0 and startup["step variants"] > 0 and startup["not compiled"] == 0
    assert startup["XLA compiles"] >= startup["step variants"]   # the counter saw start-up compile
    workload = step["compiles after start-up"].metrics
    assert workload["XLA compiles"] == 0 and workload["requests"] == 2 * len(DRY.step_workload_lens)
    for case in decode:
        m = step[case].metrics
        assert m["XLA compiles"] == 0 and math.isfinite(m["ms/step"]) and m["floor ms"] > 0
        assert m["x floor"] == pytest.approx(m["ms/step"] / m["floor ms"])


def test_the_8b_shape_starts_from_its_config_and_decodes_against_its_floor(dry_run):
    """Llama-3.1-8B's shape (tiny in the dry run) with weights the engine draws (load_format="dummy"):
    start-up, then decode at 32 sequences (2 here) held to 1.3x its bytes floor."""
    _, _, rows = dry_run
    large = {r.case: r for r in rows if r.part == "step" and r.case.startswith("8B")}
    decode = [f"8B decode {n} seqs" for n in DRY.large_decode_seqs]
    assert list(large) == ["8B start-up", *decode] and all(r.status == "ok" for r in large.values()), large
    assert large["8B start-up"].metrics["not compiled"] == 0
    for case in decode:
        m = large[case].metrics
        assert m["XLA compiles"] == 0 and m["floor ms"] > 0 and m["goal x floor"] == 1.3
        assert m["meets"] == (m["x floor"] <= 1.3) and m["weights MB"] > 0


def test_the_vision_tower_starts_up_and_times_images_without_compiling(dry_run):
    """Qwen2.5-VL-7B's tower (tiny in the dry run): every patch-count program compiled at start-up, then each
    image's milliseconds with no compilation."""
    _, _, rows = dry_run
    vision = {r.case: r for r in rows if r.part == "vision"}
    images = [f"image {side}x{side}" for side in DRY.vision_sides]
    assert list(vision) == ["start-up", *images] and all(r.status == "ok" for r in vision.values()), vision
    assert vision["start-up"].metrics["programs"] >= 1
    for case in images:
        assert vision[case].metrics["compiles"] == 0 and vision[case].metrics["ms/image"] > 0


def test_layer_variants_and_the_peer_run_and_are_compared(dry_run):
    """The layer loop unrolled and captured by command buffers, each held to the scanned loop;
    transformers' continuous batching against the engine on the same weights and workload."""
    _, _, rows = dry_run
    layers = {r.case: r for r in rows if r.part == "layers"}
    for variant in ("unrolled", "command-buffers"):
        assert layers[f"{variant} start-up"].status == "ok" and layers[f"{variant} vs scan"].status == "ok"
        assert all(layers[f"{variant} decode {n} seqs"].metrics["ms/step"] > 0 for n in DRY.step_decode_seqs)
    assert layers["choice"].metrics["fastest"] in ("scan", "unrolled", "command-buffers")
    peer = {r.case: r for r in rows if r.part == "peer"}
    assert peer["jaxpaged"].metrics["tokens out"] == peer["transformers generate_batch"].metrics["tokens out"] \
        == DRY.peer_requests * DRY.peer_new_tokens
    assert peer["ratio"].metrics["jaxpaged / transformers"] > 0


def test_the_compile_counter_sees_each_compilation_inside_its_block_only():
    import jax
    import numpy as np

    with compilations() as compiled:
        add = jax.jit(lambda x: x + 3)
        add(np.float32(1))
        add(np.float32(2))   # the same executable: no second compilation
    jax.jit(lambda x: x * 5)(np.float32(1))
    assert [name for name, _ in compiled] == ["jit(<lambda>)"]


def test_table_json_and_log_are_written_and_the_table_is_printed_last(dry_run):
    run, root, rows = dry_run
    out = root / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    table = (out / "gpu_check.md").read_text()
    assert table.count("\n| ") == len(rows) + 2   # header, separator, one line per row
    assert run.stdout.endswith(table)
    assert json.loads((out / "gpu_check.json").read_text())["meta"]["dry_run"] is True


def test_carried_wheels_install_offline_and_jax_triton_candidates_are_probed(dry_run):
    _, root, rows = dry_run
    assert (root / "site" / "site" / FAKE / "__init__.py").exists()
    chosen = [r for r in rows if r.part == "jax-triton" and r.case == "select"]
    assert chosen and chosen[0].metrics["chosen"] == str(root / "jax-triton-here")


def test_print_carry_names_the_git_ignored_wheel_folder():
    run = run_script("--print-carry")
    call = json.loads(run.stdout)
    assert call == {"carry": [".gpu_wheels"], "command": "bash scripts/gpu_check.sh", "timeout_s": 600}
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu_wheels"], cwd=REPO)
    assert ignored.returncode == 0


def test_prepare_downloads_only_small_pinned_wheels_each_jax_triton_apart():
    run = run_script("--prepare", "--dry")
    assert run.returncode == 0, run.stderr
    downloads = [line for line in run.stdout.splitlines() if " -m pip download " in line]
    specs = {line.split()[-1]: line.split(" -d ")[1].split()[0] for line in downloads}
    common = ("starlette==1.10.0", "uvicorn==0.54.0", "gguf==0.19.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
              "annotated-types==0.8.0", "typing-inspection==0.4.5")   # the server's packages the GPU image lacks
    assert specs == {**{spec: ".gpu_wheels/common" for spec in common},
                     "jax-triton==0.3.1": ".gpu_wheels/jax-triton-0.3.1",
                     "jax-triton==0.4.1": ".gpu_wheels/jax-triton-0.4.1"}
    assert all("--no-deps" in line and "--only-binary=:all:" in line for line in downloads)
    assert json.loads(run.stdout.strip().splitlines()[-1])["carry"] == [".gpu_wheels"]


def test_a_part_past_its_limit_is_killed_and_reported(tmp_path):
    ctx = Context(dry_run=True, workdir=str(tmp_path))
    rows = driver.run_in_child(driver._CHILD_PARTS["env"], ctx, limit_s=0.5)
    assert rows[-1].status == "timeout" and "killed after" in rows[-1].note


def test_parts_left_without_budget_are_skipped(tmp_path):
    rows, meta = driver.run_check(dry_run=True, budget_s=0, workdir=str(tmp_path), progress=lambda _: None)
    assert [r.status for r in rows] == ["skip"] * len(driver.PARTS)
    assert "no time left" in rows[0].note and meta["seconds"] < 5


def test_agreement_compares_greedy_tokens_with_the_reference():
    def run(name, tokens):
        return Row("engine", name, "ok", data={"tokens": tokens})
    same = [[1, 2, 3], [4, 5, 6]]
    ctx = Context(dry_run=True, workdir="", previous=[run("pallas", same), run("reference", same),
                                                      run("triton", [[9, 2, 3], [8, 5, 6]])])
    rows = {r.case: r for r in engine_agreement(ctx)}
    assert rows["agreement pallas vs reference"].status == "ok"
    assert rows["agreement triton vs reference"].status == "fail"
    assert rows["agreement triton vs reference"].metrics["first token"] == "0/2"
