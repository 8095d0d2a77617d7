"""Regressions found in review: prompt logprobs with prefix hits and preemption, min_tokens on forks,
request-id clashes with n > 1 sequence ids."""

import pytest

from jaxpaged import SamplingParams
from tests.engine.test_llm_generate import tiny_llm
from tests.engine.test_memory_features import make_llm


def test_prompt_logprobs_complete_even_when_the_prompt_is_cached():
    llm = tiny_llm()
    prompt = {"prompt_token_ids": list(range(40, 60))}
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert len(first.prompt_logprobs) == len(second.prompt_logprobs) == 20
    assert [e and sorted(e) for e in first.prompt_logprobs] == [e and sorted(e) for e in second.prompt_logprobs]


def test_prompt_logprobs_survive_recompute_preemption_of_a_chunked_prefill():
    prompts = [{"prompt_token_ids": list(range(100, 130))}, {"prompt_token_ids": list(range(20, 60))}]
    params = [SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)]
    tight = make_llm(num_gpu_blocks_override=9, max_num_batched_tokens=12, enable_prefix_caching=False,
                     max_model_len=64)
    out = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_metrics()["jaxpaged:num_preemptions_total"] > 0
    ref = tiny_llm().generate(prompts, params, use_tqdm=False)
    assert len(out[1].prompt_logprobs) == 40
    for a, b in zip(out[1].prompt_logprobs[1:], ref[1].prompt_logprobs[1:]):
        assert sorted(a) == sorted(b)
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_min_tokens_also_holds_for_the_first_token_of_forked_samples():
    llm = tiny_llm()
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, min_tokens=3, stop_token_ids=[77],
                            logit_bias={77: 100.0})
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
    for c in out.outputs:
        assert 77 not in c.token_ids[:3] and c.token_ids[3] == 77


def test_request_ids_cannot_clash_with_sequence_ids_of_n_samples():
    engine = tiny_llm().llm_engine
    engine.add_request("x#1", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="clashes"):
        engine.add_request("x", {"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert tiny_llm().get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_prompt_logprobs_with_a_token_budget_that_is_not_a_power_of_two():
    # the largest token bucket is the budget itself (200), which the 128-token logprob chunks do not divide
    prompt = {"prompt_token_ids": list(range(3, 193))}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    odd = make_llm(max_num_batched_tokens=200, max_model_len=256, enable_prefix_caching=False)
    even = make_llm(max_num_batched_tokens=256, max_model_len=256, enable_prefix_caching=False)
    a, b = (llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs for llm in (odd, even))
    assert len(a) == len(b) == 190 and a[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert sorted(x) == sorted(y)
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
