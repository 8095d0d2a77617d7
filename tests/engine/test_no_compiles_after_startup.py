"""After start-up nothing compiles: every request mix runs executables built before the first request.

Counted through JAX's own monitoring event for XLA compilations (a persistent-cache hit counts
too: it still builds an executable), while a mix of every sampling feature, prompt lengths up
to max_model_len, chunked prefill, n > 1, beam search, structured outputs, and swap and recompute
preemption runs.
"""

import contextlib

import jax
import numpy as np

from jaxpaged import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from jaxpaged.runner.batch_builder import BatchShape
from tests.tiny_models import tiny_checkpoint

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations():
    """Yields a list that collects the names of functions compiled inside the block."""
    compiled = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiled.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_no_request_mix_compiles_after_startup(monkeypatch):
    # a pool of 20 blocks of 8 tokens for up to 8 sequences of up to 128 tokens: preemption is certain;
    # 8 host blocks: some victims swap, the rest are recomputed; the host tier stores what the device
    # cache evicts and the second round loads it back
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=20,
              max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, preemption_mode="swap",
              swap_space=8 * 6144 / 2**30, kv_offloading_size=0.001, use_tqdm=False)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 320, n).tolist()} for n in (1, 5, 17, 40, 64, 90, 127, 33, 9)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, logprobs=20),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, max_tokens=9, prompt_logprobs=3),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=30),
        SamplingParams(temperature=0.0, logit_bias={7: 5.0, 9: -100.0}, min_tokens=3, max_tokens=8, logprobs=1),
        SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20, logprobs=5),
        SamplingParams(temperature=0.7, max_tokens=40, stop_token_ids=[11], ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z ]+")),
    ]
    from jaxpaged.runner import model_runner
    shapes, choose = [], model_runner.shape_for   # every step's bucket

    def recorded(*args, **kwargs):
        shapes.append(choose(*args, **kwargs))
        return shapes[-1]

    monkeypatch.setattr(model_runner, "shape_for", recorded)
    with compilations() as compiled:
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert all(o.finished for o in outs)
        llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=3, max_tokens=6))
        llm.generate(prompts[3], SamplingParams(n=4, temperature=1.0, max_tokens=50), use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["jaxpaged:num_preemptions_total"] > 0 and metrics["jaxpaged:swapped_out_blocks_total"] > 0
    assert metrics["jaxpaged:external_prefix_cache_hits_total"] > 0
    assert compiled == [], f"compiled after start-up: {compiled}"
    assert BatchShape(4, 4, 4, 1) in shapes   # a sequence decoding alone runs the smallest decode bucket


def test_speculative_steps_compile_nothing_after_startup():
    """Verifying steps of every size (drafts of 0 to k tokens, alone or beside prompt chunks, greedy
    and sampled rows) run executables built at start-up, for the target and the draft model."""
    speculative_run()


def speculative_run():
    """The run of test_speculative_steps_compile_nothing_after_startup; returns its LLM."""
    path = tiny_checkpoint("llama")
    llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, use_tqdm=False,
              speculative_config={"model": path, "num_speculative_tokens": 3})
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(3, 320, n).tolist()} for n in (1, 5, 17, 40, 64, 90, 9, 33, 12)]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (6, 12, 30, 9, 3)] + \
             [SamplingParams(temperature=0.9, seed=i, max_tokens=14, logprobs=2, n=1 + i % 2) for i in range(4)]
    with compilations() as compiled:
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_metrics()["jaxpaged:spec_decode_num_accepted_tokens_total"] > 0
    assert compiled == [], f"compiled after start-up: {compiled}"
    return llm


def test_prompt_embeddings_compile_nothing_after_startup():
    """enable_prompt_embeds: steps with and without rows (prompts of every length, chunked, beside token prompts
    and decodes) run the start-up executables; the rows' input is a copy, never a program."""
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=32, enable_prompt_embeds=True, use_tqdm=False)
    rng = np.random.default_rng(1)
    hidden = llm.llm_engine.model_config.hidden_size
    prompts = [{"prompt_embeds": rng.normal(0.0, 0.5, (n, hidden)).astype(np.float32)} for n in (1, 9, 40, 90)]
    prompts += [{"prompt_token_ids": rng.integers(3, 320, n).tolist()} for n in (5, 33)]
    with compilations() as compiled:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert compiled == []
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
