"""The built-in SmolLM2-135M-Instruct (GGUF) against transformers on the same weights, fp32 (test_gguf: our
reader gives transformers' own tensors and config, so the reference model here is built on ours)."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.loader import load_model
from jaxpaged.runner.batch_builder import BatchShape, SeqChunk
from tests.forward_batch import build_forward_batch
from jaxpaged.kernels import kv_pool_shape
from tests.fixtures_smollm2 import (BUILTIN_LEVEL, QUICKSTART_SHAPE, smollm2_hf_on_our_tensors, smollm2_path,
                                    smollm2_tokenizer)

QUESTIONS = ["What is the capital of France?", "What is 2 + 2?", "Name a primary color."]


@functools.cache
def smollm2_llm() -> LLM:
    return LLM(None, dtype="float32", **QUICKSTART_SHAPE, compile_on_startup=False, optimization_level=BUILTIN_LEVEL)


@pytest.mark.parametrize("quantization", ["auto", "gguf"])   # de-quantized at load on CPU / the blocks kept
def test_prompt_logits_match_transformers(quantization):
    import torch

    loaded = load_model(smollm2_path(), dtype="float32", quantization=quantization)
    kept = quantization == "gguf" or jax.devices()[0].platform == "gpu"   # "auto" keeps them on a GPU
    assert (loaded.quantization == "gguf") == kept
    cfg = loaded.config
    graphdef, state = nnx.split(loaded.model)
    tokens = smollm2_tokenizer().encode("The quick brown fox jumps over the lazy dog because it wanted to")
    block_size = 16
    chunk = SeqChunk(tokens, 0, [3, 1, 2], logits_positions=list(range(len(tokens))))
    batch = build_forward_batch([chunk], block_size, 8, BatchShape(32, 4, 32, 16))
    pool = jax.numpy.zeros(kv_pool_shape(cfg.num_layers, 4, block_size, cfg.num_kv_heads, cfg.head_dim))
    _, logits = jax.jit(lambda s, p, b: nnx.merge(graphdef, s)(p, b))(state, pool, batch)
    with torch.no_grad():
        ref = smollm2_hf_on_our_tensors()(torch.tensor([tokens])).logits[0].numpy()
    err = np.abs(np.asarray(logits)[:len(tokens)] - ref).max()
    assert err < 1e-3, f"max abs logit error {err}"


def hf_chat_answer(question: str, max_tokens: int) -> str:
    import torch

    tok = smollm2_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = smollm2_hf_on_our_tensors().generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_greedy_chat_answers_equal_transformers():
    llm = smollm2_llm()
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    answers = [o.outputs[0].text for o in outputs]
    assert answers[0].strip() == "The capital of France is Paris."
    for question, answer in zip(QUESTIONS, answers):
        assert answer == hf_chat_answer(question, 24), question
