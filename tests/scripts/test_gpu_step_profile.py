"""scripts/gpu_step_profile.py on CPU with tiny sizes: the GPU diagnostic runs end to end (per-step
breakdown and trace summary), so a change to the runner breaks it here and not in a GPU call."""

import json
import pathlib
import runpy
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_profile_breaks_a_decode_step_into_its_parts_and_traces_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PROFILE_CONFIGS", "5")   # the reference backend (pallas runs interpreted here)
    monkeypatch.setenv("PROFILE_TRACE", "1")
    monkeypatch.setattr(sys, "argv", ["gpu_step_profile.py", "--dry-run", "--seqs", "2", "--out", str(tmp_path)])
    runpy.run_path(str(REPO / "scripts" / "gpu_step_profile.py"), run_name="__main__")
    (row,) = json.loads((tmp_path / "step_profile.json").read_text())
    assert "error" not in row, row
    assert row["seqs"] == 2 and row["steps"] > 0
    assert all(row[k] > 0 for k in ("async_ms", "forward_ms", "sampler_ms", "fetch_ms"))
    trace = (tmp_path / "trace_2.txt").read_text()
    assert "host dispatch" in trace and "host run_forward" in trace
