"""Compiled steps saved whole: a second engine loads them without tracing, and any change to
what the step depends on (here: the engine's source) misses."""

import jax
import pytest

from jaxpaged import SamplingParams
from jaxpaged.runner import executable_cache, model_runner
from tests.engine.test_memory_features import make_llm


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JAXPAGED_COMPILATION_CACHE", str(tmp_path))   # read by every engine start-up
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", before)


def test_second_engine_loads_the_step_without_tracing(cache_dir, monkeypatch):
    prompt = {"prompt_token_ids": [5, 17, 230, 41, 9]}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    first = make_llm()
    want = first.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    saved = list((cache_dir / "jaxpaged-steps").iterdir())
    assert saved

    def no_tracing(*args, **kwargs):
        raise AssertionError("the step was traced again")

    monkeypatch.setattr(model_runner, "_step", type("Jit", (), {"lower": staticmethod(no_tracing)})())
    got = make_llm().generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.cumulative_logprob == pytest.approx(want.cumulative_logprob)


def test_a_different_source_gives_a_different_key(cache_dir, monkeypatch):
    runner = make_llm().llm_engine.runner
    shape = runner.warmup_shapes()[0]
    key = executable_cache.executable_key(("statics", shape), (runner.kv_pool,))
    monkeypatch.setattr(executable_cache, "source_digest", lambda: "edited")
    assert executable_cache.executable_key(("statics", shape), (runner.kv_pool,)) != key
    assert executable_cache.load("no-such-key") is None
