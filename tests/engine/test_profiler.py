"""vLLM's start_profile / stop_profile on JAX's profiler: a trace of what ran in between (the step's
executables and the engine's Python calls), from LLM and from the server's routes; the errors."""

import glob
import gzip
import json
import os

import pytest

from jaxpaged import LLM, SamplingParams
from tests.tiny_models import tiny_checkpoint


def traced_names(folder: str) -> set[str]:
    """The event names of the newest Perfetto trace under `folder` (one per start/stop)."""
    path = sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*", "perfetto_trace.json.gz")))[-1]
    assert glob.glob(os.path.join(os.path.dirname(path), "*.xplane.pb"))   # and TensorBoard's / XProf's file
    with gzip.open(path) as f:
        return {e.get("name") for e in json.load(f)["traceEvents"] if isinstance(e, dict)}


def test_llm_traces_the_steps_between_start_and_stop(tmp_path):
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
              compile_on_startup=False, profiler_config={"profiler": "jax", "profiler_dir": str(tmp_path / "t")})
    with pytest.raises(ValueError, match="stop_profile: no trace is running"):
        llm.stop_profile()
    llm.generate([5, 6, 7], SamplingParams(max_tokens=4), use_tqdm=False)   # compiled before: a short trace
    llm.start_profile()
    with pytest.raises(ValueError, match="start_profile: a trace is running already"):
        llm.start_profile()
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    llm.stop_profile()
    assert len(out.outputs[0].token_ids) == 4
    names = traced_names(str(tmp_path / "t"))
    assert {"PjitFunction(jit(forward_fn))", "PjitFunction(jit(sample_fn))"} <= names   # the device's steps
    assert any(n and n.startswith("$llm_engine.py") and n.endswith(" step") for n in names)   # the host's calls
    llm.start_profile()   # and again: a second trace (a run folder per second: this one may replace the first)
    llm.generate([8, 9], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.stop_profile()
    assert "PjitFunction(jit(forward_fn))" in traced_names(str(tmp_path / "t"))


def test_profiling_needs_a_config_and_a_bad_one_is_named():
    from tests.engine.test_llm_generate import tiny_llm

    with pytest.raises(ValueError, match=r"start_profile needs profiler_config=\{'profiler': 'jax'"):
        tiny_llm().start_profile()
    with pytest.raises(ValueError, match="profiler_config.profiler must be one of 'jax', got 'torch'"):
        LLM(tiny_checkpoint("llama"), profiler_config={"profiler": "torch", "profiler_dir": "/tmp/x"})
    with pytest.raises(ValueError, match="profiler_config.profiler_dir must be a folder"):
        LLM(tiny_checkpoint("llama"), profiler_config='{"profiler": "jax"}')
    with pytest.raises(ValueError, match=r"profiler_config has unknown key\(s\) \['torch_profiler_dir'\]"):
        LLM(tiny_checkpoint("llama"), profiler_config={"torch_profiler_dir": "/tmp/x"})
    import argparse

    from jaxpaged.cli import add_engine_args, engine_kwargs
    from jaxpaged.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flag = engine_kwargs(parser.parse_args(["--profiler-config", '{"profiler_dir": "/tmp/t"}']))["profiler_config"]
    assert EngineArgs(profiler_config=flag).profiler_config == flag


def test_the_server_routes_start_and_stop_a_trace(tmp_path):
    from tests.server.helpers import HTTP, serving_tiny_engine

    folder = str(tmp_path / "server")
    with serving_tiny_engine(profiler_config=json.dumps({"profiler": "jax", "profiler_dir": folder})) as url:
        HTTP.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}).raise_for_status()
        assert HTTP.post(url + "/start_profile").status_code == 200
        again = HTTP.post(url + "/start_profile")
        assert again.status_code == 400 and "a trace is running already" in again.json()["error"]["message"]
        HTTP.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}).raise_for_status()
        assert HTTP.post(url + "/stop_profile").status_code == 200
    assert "PjitFunction(jit(forward_fn))" in traced_names(folder)
    with serving_tiny_engine() as url:   # no profiler configured: no routes, as vLLM
        assert HTTP.post(url + "/start_profile").status_code == 404
