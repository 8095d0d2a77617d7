"""Quantized weights and an fp8 KV cache under every memory feature: prefix caching, chunked
prefill, swap and recompute preemption, n > 1, beam search and the HTTP server change how a
quantized engine computes, never what (greedy outputs of the same quantized engine stay identical)."""

import functools

import numpy as np
import pytest

from jaxpaged import LLM, AsyncLLM, SamplingParams
from jaxpaged.sampling_params import BeamSearchParams
from tests.engine.test_memory_features import make_llm, run
from tests.tiny_models import tiny_checkpoint

CONFIGS = {"int4+fp8": dict(quantization="int4", kv_cache_dtype="fp8"),
           "int8+fp8_e5m2": dict(quantization="int8", kv_cache_dtype="fp8_e5m2")}


@functools.cache
def plain_outputs(config: str):
    return run(make_llm(enable_prefix_caching=False, enable_chunked_prefill=False, **CONFIGS[config]))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("features", [
    dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32),
    dict(num_gpu_blocks_override=24, enable_prefix_caching=False, preemption_mode="swap", swap_space=0.001),
    dict(num_gpu_blocks_override=24, enable_prefix_caching=True, preemption_mode="recompute"),
], ids=["prefix+chunked", "swap", "recompute"])
def test_memory_features_keep_quantized_outputs(config, features):
    llm = make_llm(**CONFIGS[config], **features)
    assert llm.llm_engine.runner.kv_pool.dtype.itemsize == 1
    assert run(llm) == plain_outputs(config)
    m = llm.get_metrics()
    if "num_gpu_blocks_override" in features:
        assert m["jaxpaged:num_preemptions_total"] > 0
    if features.get("preemption_mode") == "swap":
        assert m["jaxpaged:swapped_in_blocks_total"] == m["jaxpaged:swapped_out_blocks_total"] > 0
    if features.get("enable_prefix_caching"):
        assert m["jaxpaged:prefix_cache_hits_total"] > 0


def test_fp8_kv_cache_holds_more_tokens_in_the_same_memory():
    def blocks(dtype, kv):
        return LLM(tiny_checkpoint("llama"), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 20,
                   compile_on_startup=False, max_model_len=128).llm_engine.num_blocks
    bf16 = blocks("bfloat16", "auto")
    assert blocks("bfloat16", "fp8") >= 1.9 * bf16
    assert blocks("float32", "fp8_e5m2") >= 3.9 * blocks("float32", "auto")


def test_n_and_beam_search_on_a_quantized_engine():
    llm = make_llm(**CONFIGS["int4+fp8"])
    prompt = {"prompt_token_ids": list(np.random.default_rng(9).integers(3, 320, 30))}
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    forks = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in forks.outputs] == [greedy] * 3
    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))[0]
    assert beams.sequences[0].tokens[-10:] == greedy
    wide = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))[0]
    assert len(wide.sequences) == 3
    assert wide.sequences[0].cum_logprob >= beams.sequences[0].cum_logprob - 1e-4
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_server_streams_what_the_offline_quantized_engine_generates():
    import openai

    from jaxpaged.server import build_app
    from tests.server.test_async_llm import tiny_engine_args
    from tests.server.helpers import serving

    config = dict(quantization="int8", kv_cache_dtype="fp8")
    prompt = list(np.random.default_rng(4).integers(3, 320, 20).tolist())
    offline = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=96,
                  max_model_len=256, compile_on_startup=False, **config)
    want = offline.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=12,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    engine = AsyncLLM.from_engine_args(tiny_engine_args(**config), use_tqdm=False)
    try:
        with serving(build_app(engine, ["tiny"])) as (url,):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(chunk.choices[0].text for chunk in stream) == want.outputs[0].text
    finally:
        engine.shutdown()


@functools.cache
def loud_checkpoint() -> str:
    """The tiny llama with its V projections x300: values of about a thousand, past fp8 e4m3's 448."""
    import os
    import shutil

    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoint("llama")
    dst = src + "-loud-v"
    if not os.path.isdir(dst):
        shutil.copytree(src, dst)
        tensors = load_file(os.path.join(src, "model.safetensors"))
        tensors = {k: v * 300 if "v_proj" in k else v for k, v in tensors.items()}
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_calculate_kv_scales_sets_each_layers_scales_from_the_first_prompts():
    """An fp8 pool's scales are 1.0 by default, which clips this model's V; with calculate_kv_scales, the
    first step's largest |K| and |V| per layer over fp8's largest value, kept afterwards: the prompt's
    logprobs (teacher-forced, so tokens cannot diverge) come back close to the fp32 pool's."""
    prompt = {"prompt_token_ids": list(np.random.default_rng(2).integers(3, 320, 40))}
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0, ignore_eos=True)

    def prompt_logprobs(**kwargs):
        llm = make_llm(**kwargs)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        lps = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        return np.array(lps), np.asarray(llm.llm_engine.runner.state["kv_scales"].get_value()), llm

    def llm_for(**kwargs):
        return prompt_logprobs(model=loud_checkpoint(), **kwargs)

    fp32, _, _ = llm_for()
    clipped, default_scales, _ = llm_for(kv_cache_dtype="fp8")
    calibrated, scales, llm = llm_for(kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert np.all(default_scales == 1.0)
    assert scales.shape == (3, 2) and np.all(scales > 0) and np.all(scales[:, 1] > 1.0)   # |V| > 448
    assert np.abs(calibrated - fp32).mean() < 0.05 < np.abs(clipped - fp32).mean()
    llm.generate(prompt, params, use_tqdm=False)   # kept, not calibrated again
    np.testing.assert_array_equal(np.asarray(llm.llm_engine.runner.state["kv_scales"].get_value()), scales)
