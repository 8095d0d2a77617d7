"""The two layer loops of one model: `lax.scan` over stacked layer weights and an unrolled
loop over per-layer arrays give the same logits and greedy tokens, as transformers does (fp32)."""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.cli import add_engine_args, engine_kwargs
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.models.llama import layer_weight_shapes
from jaxpaged.models.loader import load_model, resolve_scan_layers
from jaxpaged.runner.batch_builder import BatchShape, SeqChunk, choose_shape
from tests.forward_batch import build_forward_batch
from jaxpaged.kernels import kv_pool_shape
from tests.tiny_models import ARCHITECTURES, hf_logits, tiny_checkpoint

NUM_BLOCKS = 48
BLOCK_SIZE = 8
# Qwen2 with sliding windows on layers 1 and 2 only: the windows differ per layer and ride
# through the scan as an array. Mistral's window (12) covers every layer.
OVERRIDES = {"qwen2": dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)}


def checkpoint(arch: str) -> str:
    return tiny_checkpoint(arch, **OVERRIDES.get(arch, {}))


@functools.cache
def loaded(arch: str, scan_layers: bool):
    model = load_model(checkpoint(arch), dtype="float32", scan_layers=scan_layers)
    graphdef, state = nnx.split(model.model)

    @functools.partial(jax.jit, donate_argnums=1)
    def forward(state, kv_pool, batch):
        return nnx.merge(graphdef, state)(kv_pool, batch)

    return model, functools.partial(forward, state)


def greedy_run(arch: str, scan_layers: bool, prompt: list[int], num_new: int):
    """Prompt through scattered pages, then greedy decoding one token at a time.

    Returns (prompt logits [len, vocab], logits of each decode step [num_new - 1, vocab], new tokens).
    """
    model, forward = loaded(arch, scan_layers)
    cfg = model.config
    blocks = list(np.random.default_rng(1).permutation(np.arange(1, NUM_BLOCKS))[:8])
    pool = jnp.zeros(kv_pool_shape(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim),
                     jnp.float32)
    chunk = SeqChunk(prompt, 0, blocks, logits_positions=list(range(len(prompt))))
    pool, logits = forward(pool, build_forward_batch([chunk], BLOCK_SIZE, 8, BatchShape(32, 4, 32, 16)))
    prompt_logits = np.asarray(logits)[:len(prompt)]
    tokens = [int(prompt_logits[-1].argmax())]
    step_logits = []
    for _ in range(num_new - 1):
        step = SeqChunk([tokens[-1]], len(prompt) + len(tokens) - 1, blocks, logits_positions=[0])
        pool, logits = forward(pool, build_forward_batch([step], BLOCK_SIZE, 8, choose_shape([step])))
        step_logits.append(np.asarray(logits)[0])
        tokens.append(int(step_logits[-1].argmax()))
    return prompt_logits, np.stack(step_logits), tokens


def hf_greedy(path: str, prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new):
        tokens.append(int(hf_logits(path, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def test_qwen2_case_has_windows_that_differ_per_layer():
    model, _ = loaded("qwen2", True)
    assert model.config.sliding_windows == (0, 12, 12)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_loader_lays_out_the_layers_for_the_chosen_loop(scan_layers):
    model, _ = loaded("qwen3", scan_layers)
    cfg, m = model.config, model.model
    assert m.scan_layers is scan_layers
    shapes = layer_weight_shapes(cfg)
    if scan_layers:   # one [num_layers, ...] array per weight
        assert {k: v[...].shape for k, v in m.layers.items()} == {k: (cfg.num_layers, *s) for k, s in shapes.items()}
    else:
        assert len(m.layers) == cfg.num_layers
        assert all({k: v[...].shape for k, v in layer.items()} == shapes for layer in m.layers)


def test_both_layouts_hold_the_same_weights():
    unrolled, _ = loaded("qwen2", False)
    scanned, _ = loaded("qwen2", True)
    for name, stack in scanned.model.layers.items():
        for i, layer in enumerate(unrolled.model.layers):
            np.testing.assert_array_equal(np.asarray(stack[...][i]), np.asarray(layer[name][...]))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_both_loops_give_the_same_logits_and_greedy_tokens_as_transformers(arch):
    """A 30-token prompt (past the 12-token sliding windows; one 32-token bucket) and 10 greedy tokens."""
    path = checkpoint(arch)
    model, _ = loaded(arch, False)
    prompt = np.random.default_rng(5).integers(3, model.config.vocab_size, 30).tolist()
    num_new = 10
    unrolled = greedy_run(arch, False, prompt, num_new)
    scanned = greedy_run(arch, True, prompt, num_new)
    for a, b in zip(unrolled[:2], scanned[:2]):   # the loops run the same ops: near bit-equal
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
    ref = hf_logits(path, prompt)
    assert np.abs(scanned[0] - ref).max() < 1e-4 * np.abs(ref).max()
    assert unrolled[2] == scanned[2] == hf_greedy(path, prompt, num_new)


def test_engine_gives_the_same_greedy_tokens_with_both_loops():
    """Qwen2 with per-layer windows; a batch mixing prompt lengths (short and past the windows)."""
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, 320, n).tolist()} for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for scan_layers in (False, True):
        llm = LLM(checkpoint("qwen2"), dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128,
                  compile_on_startup=False, scan_layers=scan_layers, use_tqdm=False)
        assert llm.llm_engine.loaded.model.scan_layers is scan_layers
        outputs[scan_layers] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 24 for t in outputs[True])
    assert outputs[True] == outputs[False]


def test_the_default_loop_is_the_scan():
    assert resolve_scan_layers(None) is True   # compile time flat in depth, on every platform
    assert resolve_scan_layers(True) is True and resolve_scan_layers(False) is False


def test_scan_layers_flag_and_engine_arg():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["scan_layers"] is None
    assert engine_kwargs(parser.parse_args(["--scan-layers"]))["scan_layers"] is True
    assert engine_kwargs(parser.parse_args(["--no-scan-layers"]))["scan_layers"] is False
    with pytest.raises(ValueError, match="scan_layers must be None, True or False, got 'yes'"):
        EngineArgs(scan_layers="yes")
