"""Run each Colab notebook under notebooks/ top to bottom, so they cannot rot.

Each runs in a fresh Jupyter kernel of this Python, offline, on the built-in model (on a machine
without a GPU every notebook falls back to it). Any exception in any cell fails the test; then
each test checks a few things a reader would see in the outputs.
"""

import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from jaxpaged.engine.arg_utils import OPTIMIZATION_LEVEL_ENV
from tests.fixtures_smollm2 import BUILTIN_LEVEL, QUICKSTART_SHAPE

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ["quickstart.ipynb", "serving.ipynb", "paged_attention.ipynb", "rl_rollouts.ipynb"]
CELL_TIMEOUT_S = 600   # per cell; each whole notebook takes 1-3 minutes on a 2-core CPU
SAVE_TO = os.environ.get("JAXPAGED_NOTEBOOKS_OUT")   # a folder: keep the executed notebooks (CI artifacts)


@pytest.fixture(autouse=True)
def _readers_optimization_level(monkeypatch):
    """The kernels (and the server the serving notebook starts) inherit this: the engines' steps at a
    reader's default level, not the suite's 0 (see tests/fixtures_smollm2.py). XLA_FLAGS stay the
    suite's: an engine passes its level explicitly, so the flag only touches the notebooks' own small
    jits, and XLA_FLAGS are part of the compilation cache's key: with the test processes' flags, the
    notebooks and the built-in model's tests (same engine shapes, same level) read each other's steps."""
    monkeypatch.setenv(OPTIMIZATION_LEVEL_ENV, str(BUILTIN_LEVEL))


def _execute(nb, name: str) -> None:
    """Run the notebook in place: outputs land in `nb` as cells run. Raises CellExecutionError on a failing cell."""
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, startup_timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
        client.execute()
    finally:
        if SAVE_TO:
            os.makedirs(SAVE_TO, exist_ok=True)
            nbformat.write(nb, os.path.join(SAVE_TO, name))


def _load(name: str):
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def _text(nb) -> str:
    """Everything the cells printed (stdout, stderr, plain-text results), in order."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            elif "data" in out and "text/plain" in out["data"]:
                parts.append(out["data"]["text/plain"])
            elif out.get("output_type") == "error":
                parts.append("\n".join(out.get("traceback", [])))
    return "\n".join(parts)


def _num_images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def _run(nb, name: str, record_property) -> str:
    """Execute and time the notebook; returns what it printed."""
    start = time.perf_counter()
    _execute(nb, name)
    seconds = time.perf_counter() - start
    record_property("seconds", round(seconds, 1))
    print(f"{name}: {seconds:.0f} s")
    return _text(nb)


def _on_cpu() -> bool:
    import jax
    return jax.devices()[0].platform == "cpu"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs(name):
    nb = _load(name)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{name}: clear the outputs"
    assert f"colab.research.google.com/github/jaxpaged/jaxpaged/blob/main/notebooks/{name}" in nb.cells[0].source
    install = code[0].source
    assert "import jaxpaged" in install and "except ImportError" in install, "install only where jaxpaged is missing"


def test_the_notebooks_cpu_engines_have_the_shape_the_builtin_tests_share():
    """The quickstart's, the RL notebook's and the serving notebook's CPU engines are QUICKSTART_SHAPE:
    the built-in model's tests and the notebooks then compile those steps once per run."""
    code = {name: "\n".join(c.source for c in _load(name).cells if c.cell_type == "code")
            for name in ("quickstart.ipynb", "rl_rollouts.ipynb", "serving.ipynb")}
    for key, value in QUICKSTART_SHAPE.items():
        assert f"{key}={value}" in code["quickstart.ipynb"], key
        assert f"{key}={value}" in code["rl_rollouts.ipynb"], key
        flag = "--" + key.replace("_", "-")
        assert f'"{flag}", "{value}"' in code["serving.ipynb"], flag


def test_quickstart(record_property):
    nb = _load("quickstart.ipynb")
    text = _run(nb, "quickstart.ipynb", record_property)
    fell_back = "Falling back to the built-in model SmolLM2-135M-Instruct" in text
    if _on_cpu():
        assert fell_back, "on a CPU the notebook must say it uses the built-in model"
    answer = re.search(r"^Answer: (.*)$", text, re.M)
    assert answer and answer.group(1).strip(), "the chat answer is empty"
    if fell_back:
        assert "Paris" in answer.group(1)   # SmolLM2's greedy answer: "The capital of France is Paris."
    assert "same seed, same text: True" in text
    assert len(re.findall(r"^\[\d\] ", text, re.M)) == 3, "n=3 must print three completions"
    assert re.search(r"rank 1: .* logprob", text)
    rates = re.findall(r"^(jaxpaged|transformers): .* ([\d.]+) output tok/s$", text, re.M)
    assert [engine for engine, _ in rates] == ["jaxpaged", "transformers"]
    assert all(float(rate) > 0 for _, rate in rates)
    assert _num_images(nb) >= 1, "the throughput bar chart is missing"


def test_serving(record_property):
    nb = _load("serving.ipynb")
    try:
        text = _run(nb, "serving.ipynb", record_property)
        streamed = re.search(r"(\d+) chunks; the whole answer: '(.*)'", text)
        assert streamed and int(streamed.group(1)) > 1 and streamed.group(2).strip()
        assert "Paris" in streamed.group(2)
        assert re.search(r"^JSON answer: \{'city': '.*', 'country': '.*'\}$", text, re.M)
        assert "finish_reason: tool_calls" in text and re.search(r'^tool call: get_weather \{"city":', text, re.M)
        assert re.search(r"^answer: \S", text, re.M)
        assert "12 concurrent requests finished" in text
        assert _num_images(nb) >= 1, "the latency plots are missing"
        assert "jaxpaged:request_success_total" in text
        assert "server stopped (" in text
    finally:   # whatever failed (nb holds the outputs of the cells that ran), no server may outlive the test
        pid = re.search(r"server pid (\d+)", _text(nb))
        if pid is not None:
            _assert_gone(int(pid.group(1)))


def _assert_gone(pid: int) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.kill(pid, 9)
    pytest.fail(f"the server (pid {pid}) was still running after the notebook ended")


def test_paged_attention(record_property):
    nb = _load("paged_attention.ipynb")
    text = _run(nb, "paged_attention.ipynb", record_property)
    shared = re.search(r"blocks with refcount > 1: (\d+)", text)
    assert shared and int(shared.group(1)) > 0, "prefix caching shared no block"
    assert re.search(r"rome: num_cached_tokens= *[1-9]", text)
    counts = {name: int(n) for name, n in re.findall(r"jaxpaged:(swapped_(?:out|in)_blocks_total) = (\d+)", text)}
    assert counts.get("swapped_out_blocks_total", 0) > 0, "no request was swapped out"
    assert counts["swapped_in_blocks_total"] == counts["swapped_out_blocks_total"]
    assert "tokens when run alone: True" in text
    assert _num_images(nb) >= 6


def test_rl_rollouts(record_property):
    nb = _load("rl_rollouts.ipynb")
    text = _run(nb, "rl_rollouts.ipynb", record_property)
    steps = re.findall(r"^step (\d): update_weights ([\d.]+) s, mean reward ([\d.]+), rollouts changed: (\w+)$", text, re.M)
    assert [s[0] for s in steps] == ["1", "2"] and all(changed == "True" for *_, changed in steps)
    memory = re.search(r"device memory: (\d+) MB awake, (\d+) MB asleep; is sleeping after wake_up: False", text)
    assert memory and int(memory.group(2)) < int(memory.group(1))
    assert re.search(r"^a rollout after waking up: \S", text, re.M)
