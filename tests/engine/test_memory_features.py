"""Prefix caching, chunked prefill, swap and recompute preemption, copy-on-write forks:
each changes how requests are computed, never what (greedy fp32 outputs stay identical)."""

import functools

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.tiny_models import tiny_checkpoint

BLOCK = 8


def make_llm(model: str | None = None, **kwargs) -> LLM:
    opts = dict(dtype="float32", block_size=BLOCK, num_gpu_blocks_override=96, max_model_len=128,
                compile_on_startup=False, max_num_seqs=16)
    opts.update(kwargs)
    return LLM(model or tiny_checkpoint("llama"), **opts)


@functools.cache
def workload():
    """A dozen mixed-length requests; some share a 24-token prefix."""
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 320, 24).tolist()
    prompts, params = [], []
    for i, n in enumerate([5, 40, 17, 33, 8, 64, 24, 12, 50, 9, 31, 16]):
        tokens = rng.integers(3, 320, n).tolist()
        prompts.append({"prompt_token_ids": (shared + tokens) if i % 3 == 0 else tokens})
        params.append(SamplingParams(temperature=0.0, max_tokens=int(rng.integers(6, 16)), ignore_eos=True))
    return prompts, params


def run(llm: LLM) -> list[list[int]]:
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"
    assert llm.llm_engine.kv_cache.host_usage() == 0.0, "host blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def plain_outputs():
    return run(make_llm(enable_prefix_caching=False, enable_chunked_prefill=False))


def test_prefix_caching_keeps_outputs():
    llm = make_llm(enable_prefix_caching=True, enable_chunked_prefill=False)
    assert run(llm) == plain_outputs()
    assert llm.get_metrics()["jaxpaged:prefix_cache_hits_total"] > 0


def test_chunked_prefill_at_32_token_budget_keeps_outputs():
    llm = make_llm(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=32)
    assert run(llm) == plain_outputs()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tiny_pool_preemption_keeps_outputs(mode):
    # 24 blocks of 8 = 192 tokens for a dozen requests of up to 100 tokens each
    llm = make_llm(num_gpu_blocks_override=24, enable_prefix_caching=False, preemption_mode=mode,
                   swap_space=0.001)
    assert run(llm) == plain_outputs()
    m = llm.get_metrics()
    assert m["jaxpaged:num_preemptions_total"] > 0
    if mode == "swap":
        assert m["jaxpaged:swapped_out_blocks_total"] > 0
        assert m["jaxpaged:swapped_in_blocks_total"] == m["jaxpaged:swapped_out_blocks_total"]
    else:
        assert m["jaxpaged:swapped_out_blocks_total"] == 0
    assert m["jaxpaged:num_requests_swapped"] == 0


def test_shared_system_prompt_is_cached():
    llm = make_llm(block_size=16, num_gpu_blocks_override=48)
    rng = np.random.default_rng(5)
    system = rng.integers(3, 320, 100).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": system + [7, 8, 9]}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    others = llm.generate([{"prompt_token_ids": system + rng.integers(3, 320, k).tolist()} for k in (3, 9, 20)],
                          params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 96 for o in others)
    fresh = make_llm(block_size=16, num_gpu_blocks_override=48, enable_prefix_caching=False)
    again = fresh.generate([{"prompt_token_ids": o.prompt_token_ids} for o in others], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in others] == [o.outputs[0].token_ids for o in again]
    m = llm.get_metrics()
    assert m["jaxpaged:prefix_cache_hits_total"] >= 3 * 96
    assert m["jaxpaged:prefix_cache_queries_total"] >= m["jaxpaged:prefix_cache_hits_total"]


@pytest.mark.parametrize("caching", [True, False])
def test_n4_samples_share_the_prompt_blocks(caching):
    # prompt of 61 tokens = 8 blocks; 4 private copies with 12 outputs would need 4 x 10 = 40 blocks
    llm = make_llm(num_gpu_blocks_override=24, enable_prefix_caching=caching, max_model_len=96)
    prompt = {"prompt_token_ids": list(np.random.default_rng(9).integers(3, 320, 61))}
    out = llm.generate(prompt, SamplingParams(n=4, temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    single = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert all(c.token_ids == single.outputs[0].token_ids for c in out.outputs)
    m = llm.get_metrics()
    assert m["jaxpaged:num_preemptions_total"] == 0
    assert m["jaxpaged:kv_cache_usage_perc"] == 0.0
    sampled = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1


# Structured outputs under the same memory features: a request's grammar matcher is kept across
# preemption (recompute re-prefills tokens it has already consumed), so constrained greedy
# outputs are the same token for token and stay valid.
WORDS = r"[a-z]{2,6}( [a-z]{2,6}){2,4}"
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4,
           "x-guidance": {"whitespace_flexible": False}}


@functools.cache
def constrained_workload():
    from jaxpaged import StructuredOutputsParams
    prompts, _ = workload()
    kinds = [dict(regex=WORDS), dict(json=NUMBERS), dict(choice=["alpha", "beta gamma"])]
    params = [SamplingParams(temperature=0.0, max_tokens=48, stop=[" "] if i % 4 == 3 else None,
                             structured_outputs=StructuredOutputsParams(**kinds[i % 3])) for i in range(len(prompts))]
    return prompts, params


def run_constrained(llm: LLM) -> list[tuple[str, str]]:
    import json
    import re
    prompts, params = constrained_workload()
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"
    for out, p in zip(outs, params):
        so = p.structured_outputs
        assert out.finish_reason == "stop", (out.text, so)
        if so.regex:   # with the stop string " ": its first word
            assert re.fullmatch(r"[a-z]{2,6}" if p.stop else WORDS, out.text), out.text
        elif so.json:
            value = json.loads(out.text)
            assert 2 <= len(value) <= 4 and all(0 <= v <= 99 for v in value), out.text
        else:
            assert out.text in (["alpha", "beta"] if p.stop else so.choice), out.text
    return [(out.text, tuple(out.token_ids)) for out in outs]


@pytest.mark.parametrize("opts", [
    dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32),
    dict(num_gpu_blocks_override=24, enable_prefix_caching=False, preemption_mode="swap", swap_space=0.001),
    dict(num_gpu_blocks_override=24, enable_prefix_caching=False, preemption_mode="recompute"),
], ids=["prefix-chunked", "swap", "recompute"])
def test_constrained_outputs_are_kept_by_every_memory_feature(opts):
    plain = run_constrained(make_llm(enable_prefix_caching=False, enable_chunked_prefill=False))
    llm = make_llm(**opts)
    assert run_constrained(llm) == plain
    if "preemption_mode" in opts:
        assert llm.get_metrics()["jaxpaged:num_preemptions_total"] > 0
