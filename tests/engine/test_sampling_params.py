"""SamplingParams and BeamSearchParams: vLLM's defaults, normalization, and errors that
name the field, the value and the allowed range."""

import dataclasses
import math

import pytest

from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=(2, 3), top_k=-1, logit_bias={"50": -100, 7: 2.5})
    assert p.stop == ["###"]
    assert p.stop_token_ids == [2, 3]
    assert p.top_k == 0
    assert p.logit_bias == {50: -100.0, 7: 2.5}
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_replace_revalidates_and_keeps_normalized_values():
    p = dataclasses.replace(SamplingParams(stop="x", top_k=-1), temperature=0.5)
    assert (p.stop, p.top_k, p.temperature) == (["x"], 0, 0.5)
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)


@pytest.mark.parametrize(
    ("temperature", "seed", "expected"),
    [(0.0, None, SamplingType.GREEDY), (1e-6, 3, SamplingType.GREEDY), (0.7, None, SamplingType.RANDOM),
     (0.7, 0, SamplingType.RANDOM_SEED)],
)
def test_sampling_type(temperature, seed, expected):
    p = SamplingParams(temperature=temperature, seed=seed)
    assert p.sampling_type == expected
    assert p.is_greedy == (expected == SamplingType.GREEDY)


# (field overrides, text the error must contain: the field, the bad value and the range)
INVALID = [
    ({"n": 0}, ["n", "0", ">= 1"]),
    ({"n": 1.5}, ["n", "1.5", "integer"]),
    ({"temperature": -0.1}, ["temperature", "-0.1", ">= 0.0"]),
    ({"temperature": math.nan}, ["temperature", "nan"]),
    ({"top_p": 0.0}, ["top_p", "0.0", "(0.0, 1.0]"]),
    ({"top_p": 1.01}, ["top_p", "1.01", "(0.0, 1.0]"]),
    ({"top_k": -2}, ["top_k", "-2", ">= 1"]),
    ({"min_p": 1.5}, ["min_p", "1.5", "[0.0, 1.0]"]),
    ({"presence_penalty": 2.5}, ["presence_penalty", "2.5", "[-2.0, 2.0]"]),
    ({"frequency_penalty": -3}, ["frequency_penalty", "-3", "[-2.0, 2.0]"]),
    ({"repetition_penalty": 0.0}, ["repetition_penalty", "0.0", "> 0.0"]),
    ({"max_tokens": 0}, ["max_tokens", "0", ">= 1"]),
    ({"min_tokens": -1}, ["min_tokens", "-1", ">= 0"]),
    ({"min_tokens": 20, "max_tokens": 10}, ["min_tokens", "20", "max_tokens=10"]),
    ({"logprobs": -1}, ["logprobs", "-1", "not supported", f"[0, {MAX_LOGPROBS}]"]),
    ({"logprobs": MAX_LOGPROBS + 1}, ["logprobs", str(MAX_LOGPROBS + 1), f"[0, {MAX_LOGPROBS}]"]),
    ({"prompt_logprobs": -5}, ["prompt_logprobs", "-5", f"[0, {MAX_LOGPROBS}]"]),
    ({"stop": ["ok", ""]}, ["stop", "''", "non-empty"]),
    ({"stop": 5}, ["stop", "5"]),
    ({"stop": "x", "detokenize": False}, ["stop", "detokenize"]),
    ({"stop_token_ids": [1, -2]}, ["stop_token_ids", "-2", ">= 0"]),
    ({"logit_bias": {"5": 101}}, ["logit_bias[5]", "101", "[-100.0, 100.0]"]),
    ({"logit_bias": {"abc": 1}}, ["logit_bias", "'abc'", "integers >= 0"]),
    ({"logit_bias": {-3: 1}}, ["logit_bias", "-3", "integers >= 0"]),
    ({"seed": "42"}, ["seed", "'42'", "integer"]),
    ({"seed": 1.0}, ["seed", "1.0", "integer"]),
]


@pytest.mark.parametrize(("overrides", "fragments"), INVALID, ids=[str(o) for o, _ in INVALID])
def test_invalid_values_raise_value_error_naming_field_value_and_range(overrides, fragments):
    with pytest.raises(ValueError) as err:
        SamplingParams(**overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [{"temperature": 0.0}, {"top_p": 1.0}, {"top_k": 1}, {"min_p": 1.0}, {"presence_penalty": -2.0},
     {"frequency_penalty": 2.0}, {"min_tokens": 16, "max_tokens": 16}, {"logprobs": 0},
     {"logprobs": MAX_LOGPROBS}, {"prompt_logprobs": 0}, {"logit_bias": {"1": -100, "2": 100}},
     {"max_tokens": None, "min_tokens": 1000}, {"seed": 0}],
)
def test_boundary_values_are_accepted(overrides):
    SamplingParams(**overrides)


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[2] = 2.0
    q.max_tokens = 99
    assert p.stop == ["a"] and p.logit_bias == {1: 1.0} and p.max_tokens == 16
    assert q == SamplingParams(stop=["a", "b"], logit_bias={1: 1.0, 2: 2.0}, max_tokens=99)


def test_beam_search_params():
    p = BeamSearchParams(beam_width=4, max_tokens=32)
    assert (p.ignore_eos, p.temperature, p.length_penalty) == (False, 0.0, 1.0)
    for kwargs, field in [({"beam_width": 0, "max_tokens": 8}, "beam_width"),
                          ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                          ({"beam_width": 2, "max_tokens": 8, "temperature": -1.0}, "temperature")]:
        with pytest.raises(ValueError, match=f"{field} must be"):
            BeamSearchParams(**kwargs)


def test_outputs_report_finished_state():
    running = CompletionOutput(0, "Par", [5], -0.5, [{5: Logprob(-0.5, 1, "Par")}])
    done = CompletionOutput(1, "Paris.", [5, 6], -0.7, None, finish_reason="stop", stop_reason=".")
    assert not running.finished() and done.finished()
    out = RequestOutput("req-0", "Capital?", [1, 2], [None, {2: Logprob(-1.0)}], [running, done], finished=False)
    assert out.num_cached_tokens == 0 and out.metrics is None
    assert "req-0" in repr(out) and "Paris." in repr(out)
