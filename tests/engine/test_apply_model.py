"""vLLM's LLM.apply_model and collective_rpc: research code reaches the model and the worker (here each
replica's ModelRunner) without reaching into engine internals; the model is read, not changed."""

import asyncio

import numpy as np
import pytest

from jaxpaged import LLM, AsyncLLM, SamplingParams
from tests.engine.test_llm_generate import tiny_llm
from tests.server.test_async_llm import tiny_engine_args
from tests.tiny_models import hf_model, tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_apply_model_reads_and_writes_the_weights_in_place():
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=16, max_model_len=64,
              compile_on_startup=False)
    (table,) = llm.apply_model(lambda model: np.asarray(model.embed.get_value()))
    np.testing.assert_allclose(table, hf_model(tiny_checkpoint("llama")).get_input_embeddings().weight.detach().numpy())
    prompt = {"prompt_token_ids": list(range(5, 25))}
    before = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    # another shape: refused, nothing kept
    with pytest.raises(ValueError, match="changed weight embed from"):
        llm.apply_model(lambda model: model.embed.set_value(np.zeros((3, 3), np.float32)))
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before.outputs[0].token_ids
    # the same shape from NumPy: written, placed, and the prefix cache does not hand back the old K/V
    swapped = table[::-1].copy()
    llm.apply_model(lambda model: model.embed.set_value(swapped))
    after = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids != before.outputs[0].token_ids
    llm.apply_model(lambda model: model.embed.set_value(table))
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == before.outputs[0].token_ids and again.num_cached_tokens == 0
    llm.sleep(1)
    with pytest.raises(ValueError, match="sleeping"):
        llm.apply_model(lambda model: None)
    llm.wake_up()
    assert llm.apply_model(lambda model: model.config.num_layers) == [llm.llm_engine.model_config.num_layers]


def test_collective_rpc_calls_the_runner():
    llm = tiny_llm()
    assert llm.collective_rpc(lambda runner, extra: runner.num_blocks + extra, args=(1,)) == [97]
    shapes = llm.collective_rpc("warmup_shapes")[0]
    assert shapes and all(s.num_tokens >= 1 for s in shapes)
    for bad in ("no_such_method", "_executables", 3):
        with pytest.raises(ValueError, match="collective_rpc"):
            llm.collective_rpc(bad)


def test_async_collective_rpc():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    try:
        assert asyncio.run(engine.collective_rpc(lambda runner: runner.block_size)) == [8]
    finally:
        engine.shutdown()
