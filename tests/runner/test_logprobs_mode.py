"""vLLM's logprobs_mode: what a sampled token's logprob and the top-K hold. Raw: the model's log-softmax (or
its logits); processed: the distribution the token was drawn from, after bias, penalties, temperature,
min_p, top-k and top-p (masked tokens -inf), which a policy-gradient loop reads as its behaviour policy."""

import functools

import jax
import numpy as np
import pytest

from jaxpaged import LLM, EngineArgs, SamplingParams
from jaxpaged.runner.sampler import plain_greedy, sample
from tests.runner.test_sampler import V, log_softmax, metadata, params
from tests.tiny_models import hf_logits, tiny_checkpoint

S = 8


@functools.partial(jax.jit, static_argnames=("mode", "branch_free"))
def sample_mode(logits, md, mode, branch_free=False):
    return sample(logits, md, branch_free, logprobs_mode=mode)


def test_each_mode_reports_the_logits_it_names():
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 2.0, (S, V)).astype(np.float32)
    rows = [params(temperature=0.0, logprobs=V), params(temperature=0.5, logprobs=V),
            params(temperature=2.0, top_k=3, logprobs=V), params(temperature=1.0, min_p=0.2, logprobs=V),
            params(temperature=0.0, logit_bias={4: 3.0}, logprobs=V)]
    md = metadata(rows, S, seeds=[1, 2, 3, 4, 5])
    md = type(md)(**{**md.__dict__, "num_logprobs": V})
    outs = {mode: jax.tree.map(np.asarray, sample_mode(logits, md, mode)) for mode in
            ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")}
    tokens = outs["raw_logprobs"].token_ids
    for out in outs.values():   # the mode changes what is reported, never what is drawn
        np.testing.assert_array_equal(out.token_ids, tokens)

    def reported(out, i):   # token id -> value over the whole vocabulary (top-K is all of it here)
        values = np.full(V, np.nan)
        values[out.topk_ids[i]] = out.topk_logprobs[i]
        return values

    drawn = logits.astype(np.float64).copy()
    drawn[1] /= 0.5
    drawn[2] /= 2.0
    drawn[2][drawn[2] < np.sort(drawn[2])[-3]] = -np.inf      # top-3
    floor = drawn[3].max() + np.log(0.2)
    drawn[3][drawn[3] < floor] = -np.inf                      # min_p: p < 0.2 p_max
    drawn[4][4] += 3.0                                        # a greedy row: bias only, no temperature
    for i in range(5):
        np.testing.assert_allclose(reported(outs["raw_logprobs"], i), log_softmax(logits[i]), atol=1e-5)
        np.testing.assert_allclose(reported(outs["raw_logits"], i), logits[i], atol=1e-6)
        np.testing.assert_allclose(reported(outs["processed_logits"], i), drawn[i], atol=1e-5)
        np.testing.assert_allclose(reported(outs["processed_logprobs"], i), log_softmax(drawn[i]), atol=1e-5)
        for mode, out in outs.items():   # the sampled token's own value and rank agree with its row
            assert out.logprobs[i] == pytest.approx(reported(out, i)[tokens[i]], abs=1e-5), mode
            assert out.ranks[i] == 1 + np.sum(reported(out, i) > reported(out, i)[tokens[i]]), mode
    assert np.isinf(outs["processed_logprobs"].topk_logprobs[2, 3:]).all()   # what top-k cut is -inf
    # a GPU's branch-free sampler (the host knows no row truncates) reports the same
    untruncated = metadata([rows[i] for i in (0, 1, 3, 4)], S, seeds=[1, 2, 4, 5])
    untruncated = type(md)(**{**untruncated.__dict__, "num_logprobs": V})
    for mode in ("processed_logprobs", "processed_logits"):
        both = [jax.tree.map(np.asarray, sample_mode(logits[[0, 1, 3, 4, 5, 6, 7, 7]], untruncated, mode, flag))
                for flag in (False, True)]
        np.testing.assert_array_equal(both[0].token_ids, both[1].token_ids)
        np.testing.assert_allclose(both[0].topk_logprobs[:4], both[1].topk_logprobs[:4], atol=1e-6)
    fast = plain_greedy(logits, 1, 0, logprobs_mode="raw_logits")
    np.testing.assert_allclose(np.asarray(fast.logprobs), logits.max(-1))


@functools.cache
def mode_llm(mode: str) -> LLM:
    return LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=32,
               max_model_len=64, compile_on_startup=False, logprobs_mode=mode)


def test_processed_logprobs_are_the_drawn_distribution_of_the_raw_ones():
    """Same seeds, same tokens; each processed top-5 is the raw top-5 under temperature and top_k=5,
    renormalised: exp sums to 1, the importance ratio an RL loop needs is exact."""
    prompt = {"prompt_token_ids": [5, 17, 42, 9, 33, 61, 7]}
    p = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=12, logprobs=5, ignore_eos=True)
    raw = mode_llm("raw_logprobs").generate(prompt, p, use_tqdm=False)[0].outputs[0]
    processed = mode_llm("processed_logprobs").generate(prompt, p, use_tqdm=False)[0].outputs[0]
    assert processed.token_ids == raw.token_ids
    for token, r, q in zip(raw.token_ids, raw.logprobs, processed.logprobs):
        assert sorted(r) == sorted(q)   # the same five tokens
        ids = sorted(r)
        expected = log_softmax(np.array([r[t].logprob for t in ids]) / 0.7)
        np.testing.assert_allclose([q[t].logprob for t in ids], expected, atol=1e-4)
        assert sum(np.exp(q[t].logprob) for t in ids) == pytest.approx(1.0, abs=1e-4)
    assert processed.cumulative_logprob == pytest.approx(sum(q[t].logprob for t, q in
                                                             zip(processed.token_ids, processed.logprobs)), abs=1e-3)


def test_raw_logits_are_transformers_logits():
    prompt = [5, 17, 42, 9, 33, 61, 7]
    p = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    out = mode_llm("raw_logits").generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0]
    expected = hf_logits(tiny_checkpoint("llama"), prompt)[-1]
    for token, entry in out.logprobs[0].items():
        assert entry.logprob == pytest.approx(float(expected[token]), abs=1e-3)
    plain = mode_llm("raw_logits").generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1,
                                                                                         logprobs=0), use_tqdm=False)
    token = plain[0].outputs[0].token_ids[0]
    assert plain[0].outputs[0].logprobs[0][token].logprob == pytest.approx(float(expected[token]), abs=1e-3)


def test_beam_search_refuses_logits_in_place_of_logprobs():
    from jaxpaged import BeamSearchParams

    with pytest.raises(ValueError, match="beam search ranks beams by logprobs"):
        mode_llm("raw_logits").beam_search([[5, 17, 42]], BeamSearchParams(beam_width=2, max_tokens=2))


def test_an_unknown_mode_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="logprobs_mode must be one of 'raw_logprobs', 'raw_logits'"):
        EngineArgs(logprobs_mode="logits")
