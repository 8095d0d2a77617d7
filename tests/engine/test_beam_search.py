"""Beam search against transformers' generate(num_beams=..., do_sample=False) on tiny models."""

import numpy as np
import pytest

from jaxpaged import BeamSearchParams
from tests.engine.test_llm_generate import tiny_llm
from tests.tiny_models import hf_model, tiny_checkpoint


def hf_beams(arch, prompt, width, max_tokens):
    import torch

    model = hf_model(tiny_checkpoint(arch))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True, length_penalty=1.0)
    return [seq[len(prompt):].tolist() for seq in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("arch,width", [("llama", 2), ("llama", 4), ("qwen3", 3)])
def test_beam_search_matches_transformers(arch, width):
    llm = tiny_llm(arch)
    rng = np.random.default_rng(width)
    prompts = [rng.integers(3, 320, n).tolist() for n in (5, 12)]
    max_tokens = 8
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        ref_tokens, ref_scores = hf_beams(arch, prompt, width, max_tokens)
        ours = [s.tokens[len(prompt):] for s in out.sequences]
        assert ours[0] == ref_tokens[0]
        assert ours == ref_tokens
        for seq, score in zip(out.sequences, ref_scores):
            assert abs(seq.cum_logprob / max_tokens - score) < 1e-4
            assert seq.tokens[:len(prompt)] == prompt
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0
    assert not llm.llm_engine.scheduler.requests


def test_beam_search_in_a_tight_pool_gives_the_same_beams():
    from jaxpaged import LLM

    def run(num_blocks):
        llm = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=num_blocks,
                  max_model_len=40, compile_on_startup=False)
        try:
            return llm.beam_search([{"prompt_token_ids": list(range(3, 23))}],
                                   BeamSearchParams(beam_width=4, max_tokens=19, ignore_eos=True))
        finally:
            assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0
            assert not llm.llm_engine.scheduler.requests and not llm.llm_engine.has_unfinished_requests()

    roomy = run(64)
    # beams are requests: where the pool holds one 38-token beam (5 blocks) but not four, they take turns
    for tight in (run(10), run(6)):
        assert [s.tokens for s in tight[0].sequences] == [s.tokens for s in roomy[0].sequences]
        assert [s.cum_logprob for s in tight[0].sequences] == pytest.approx([s.cum_logprob for s in roomy[0].sequences],
                                                                            abs=1e-5)


def test_beam_search_refuses_a_constraint_clearly():
    from jaxpaged import SamplingParams, StructuredOutputsParams
    llm = tiny_llm()
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match="structured_outputs is not supported by beam search"):
        llm.beam_search([[5, 6, 7]], constrained)
    with pytest.raises(ValueError, match="beam_search takes a BeamSearchParams"):
        llm.beam_search([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences
