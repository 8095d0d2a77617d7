"""Phi-3's LongRoPE through the engine against transformers' generate (fp32), at every length.

The tiny checkpoint switches to its long factors past 32 tokens (original_max_position_embeddings).
transformers' Phi-3 encodes a sequence with the factors of its whole length, and recomputes its
cache once a generation grows past the switch; the engine must give the same tokens and
logprobs whether a prompt is cold, chunked or partly cached, and when a generation crosses.
"""

import functools

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.tiny_models import hf_model, tiny_checkpoint

SWITCH = 32          # the checkpoint's original_max_position_embeddings
MAX_TOKENS = 8


def checkpoint() -> str:
    return tiny_checkpoint("phi3", rope="longrope")


@functools.cache
def engine(max_num_batched_tokens: int | None = None) -> LLM:
    extra = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    return LLM(checkpoint(), dtype="float32", block_size=8, num_gpu_blocks_override=96, max_model_len=128,
               compile_on_startup=False, **extra)


def hf_generate(prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs."""
    import torch

    model = hf_model(checkpoint())
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_matches_transformers(prompt: list[int], output) -> None:
    ref_tokens, ref_logprobs = hf_generate(prompt)
    completion = output.outputs[0]
    assert completion.token_ids == ref_tokens
    ours = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
    np.testing.assert_allclose(ours, ref_logprobs, atol=1e-4)


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 320, n).tolist() for n in lengths]


def test_the_checkpoint_switches_factors_in_transformers():
    """Guards the fixture: a Phi3Config's own original_max_position_embeddings overrides rope_parameters'."""
    config = hf_model(checkpoint()).config
    assert config.original_max_position_embeddings == SWITCH and config.rope_parameters["rope_type"] == "longrope"
    assert engine().llm_engine.model_config.rope_switch_len == SWITCH


# 20: short throughout; 28: crosses the switch while generating; 33 and 40: long from the start
@pytest.mark.parametrize("budget", [None, 16], ids=["whole", "chunked"])
def test_cold_prompts_and_generations_crossing_the_switch(budget):
    llm = engine(budget)
    batch = prompts(budget or 0, 20, 28, 33, 40)
    for prompt, output in zip(batch, generate(llm, batch)):
        assert_matches_transformers(prompt, output)
    assert llm.llm_engine.kv_cache.usage() == 0.0


def test_prefix_cache_hits_never_mix_short_and_long_factors():
    """A long prompt extending a cached short one computes its whole prefix again (its K/V needs the
    long factors); the same long prompt later hits what the first computed; a short prompt extending
    nothing long hits a short one's blocks."""
    llm = engine()
    short, tail, more = prompts(5, 24, 16, 4)
    long_prompt = short + tail                       # 40 tokens: long
    (first,) = generate(llm, [short])
    assert_matches_transformers(short, first)
    (cold_long,) = generate(llm, [long_prompt])
    assert cold_long.num_cached_tokens == 0          # the short prompt's blocks hold short-factor K/V
    assert_matches_transformers(long_prompt, cold_long)
    (warm_long,) = generate(llm, [long_prompt + more])
    assert warm_long.num_cached_tokens == 40
    assert_matches_transformers(long_prompt + more, warm_long)
    (warm_short,) = generate(llm, [short + more])     # 28 tokens: short, on the first prompt's blocks
    assert warm_short.num_cached_tokens == 24
    assert_matches_transformers(short + more, warm_short)
