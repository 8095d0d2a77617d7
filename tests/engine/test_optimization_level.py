"""`optimization_level` (vLLM's -O0..-O3): the step's programs compile with the level's XLA
options, every level gives the same greedy tokens and logprobs, and a bad level is a ValueError."""

import argparse

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.cli import add_engine_args, engine_kwargs
from jaxpaged.engine.arg_utils import OPTIMIZATION_LEVEL_ENV, EngineArgs
from tests.tiny_models import tiny_checkpoint


def test_each_level_compiles_with_its_options_and_gives_the_same_greedy_outputs(monkeypatch):
    compile_options = []
    original = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kwargs):
        compile_options.append(compiler_options)
        return original(self, compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 77]}, {"prompt_token_ids": [8, 8, 21]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    outputs, options = {}, {}
    for level in (0, 2):
        compile_options.clear()
        llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=64, max_num_seqs=2,
                  max_num_batched_tokens=16, compile_on_startup=False, optimization_level=level, use_tqdm=False)
        outputs[level] = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        options[level] = [o for o in compile_options if o is not None]
        del llm
    assert options[0] and all(o == {"xla_backend_optimization_level": 0} for o in options[0])   # forward, sampler
    assert options[2] and all(o == {"xla_backend_optimization_level": 3} for o in options[2])   # XLA's default,
    # explicit: the suite's XLA_FLAGS put every other program at 0 (tests/conftest.py)
    for fast_compile, default in zip(outputs[0], outputs[2]):
        assert fast_compile.token_ids == default.token_ids
        np.testing.assert_allclose([lp[t].logprob for t, lp in zip(default.token_ids, fast_compile.logprobs)],
                                   [lp[t].logprob for t, lp in zip(default.token_ids, default.logprobs)], atol=1e-5)


@pytest.mark.parametrize("level", [4, -1, True, "2", 1.0])
def test_a_bad_level_is_a_value_error_naming_it(level):
    with pytest.raises(ValueError, match="optimization_level must be 0, 1, 2 or 3"):
        EngineArgs(optimization_level=level)


def test_the_environment_gives_the_default_and_the_argument_wins(monkeypatch):
    monkeypatch.setenv(OPTIMIZATION_LEVEL_ENV, "1")
    assert EngineArgs().optimization_level == 1
    assert EngineArgs(optimization_level=3).optimization_level == 3
    monkeypatch.delenv(OPTIMIZATION_LEVEL_ENV)
    assert EngineArgs().optimization_level == 2
    monkeypatch.setenv(OPTIMIZATION_LEVEL_ENV, "fast")
    with pytest.raises(ValueError, match=f"{OPTIMIZATION_LEVEL_ENV} must be 0, 1, 2 or 3, got 'fast'"):
        EngineArgs()


def test_the_cli_takes_vllms_short_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["-O0"]))["optimization_level"] == 0
    assert engine_kwargs(parser.parse_args(["--optimization-level", "3"]))["optimization_level"] == 3
    assert engine_kwargs(parser.parse_args([]))["optimization_level"] is None   # the default (or the environment's)
