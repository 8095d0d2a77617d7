"""The native CPU matmul (pallas_kernels/cpu_matmul.cc) against float64 numpy, and the model's use
of it: with the `cpu` backend on one CPU device the scanned layer loop hands each layer's f32
weights to the kernel whole (no slice copied out of the stack) and gives the XLA model's logits."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.models.llama import NATIVE_MATMULS, layer_weight_shapes
from jaxpaged.models.loader import load_model
from jaxpaged.runner.batch_builder import SeqChunk, build_forward_batch, choose_shape
from jaxpaged.kernels import cpu_matmul, kv_pool_shape
from tests.tiny_models import tiny_checkpoint


def _close(got, x, w):
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# N: whole 64-column panels, then 2 / 1 / 3 / 0 leftover vectors of 16 and leftover columns;
# M: one row, part of an 8-row tile, a whole tile, tiles plus a part.
@pytest.mark.parametrize("m,k,n", [(1, 5, 1), (7, 37, 100), (8, 64, 64), (5, 24, 81), (9, 48, 176), (33, 96, 135),
                                   (20, 576, 960)])
def test_matches_float64_for_plain_and_stacked_weights(m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k), np.float32)
    stack = rng.standard_normal((3, k, n), np.float32)
    _close(cpu_matmul.matmul_cpu(x, stack[1]), x, stack[1])
    traced = jax.jit(cpu_matmul.matmul_cpu)
    for layer in range(3):   # the index traced, as in the scan
        _close(traced(x, stack, layer), x, stack[layer])


@pytest.mark.parametrize("m,k,n", [(0, 8, 16), (3, 0, 16), (3, 8, 0)])
def test_empty_shapes(m, k, n):
    x, w = jnp.ones((m, k), jnp.float32), jnp.ones((2, k, n), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_matmul.matmul_cpu)(x, w, 1)), np.zeros((m, n)))


def test_only_the_live_rows_are_multiplied_and_the_rest_are_zeros():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((19, 40), np.float32)
    stack = rng.standard_normal((2, 40, 72), np.float32)
    traced = jax.jit(cpu_matmul.matmul_cpu)
    for live in (0, 1, 8, 11, 19, 25, -3):   # clamped to [0, 19]
        got = np.asarray(traced(x, stack, 1, live))
        rows = min(max(live, 0), 19)
        if rows:
            _close(got[:rows], x[:rows], stack[1])
        np.testing.assert_array_equal(got[rows:], 0.0)


def test_bad_inputs_are_errors_naming_what_it_takes():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"takes f32 x \[M, K\].*bfloat16\[8, 16\]"):
        cpu_matmul.matmul_cpu(x, jnp.ones((8, 16), jnp.bfloat16))
    with pytest.raises(ValueError, match="float32\\[4, 8\\] and float32\\[9, 16\\]"):
        cpu_matmul.matmul_cpu(x, jnp.ones((9, 16), jnp.float32))
    with pytest.raises(Exception, match="layer index out of range"):   # a traced index is checked when it runs
        jax.jit(cpu_matmul.matmul_cpu)(x, jnp.ones((2, 8, 16), jnp.float32), 2).block_until_ready()


def _forward(model):
    graphdef, state = nnx.split(model.model)
    return jax.jit(lambda state, pool, batch: nnx.merge(graphdef, state)(pool, batch)), state


PROMPT_LEN = 21   # one prompt step, padded to its token bucket


def _prompt_step(cfg, seed: int):
    """An empty KV pool and a ForwardBatch of one PROMPT_LEN-token prompt asking logits at every token."""
    pool = jnp.zeros(kv_pool_shape(cfg.num_layers, 16, 8, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    prompt = np.random.default_rng(seed).integers(3, cfg.vocab_size, PROMPT_LEN).tolist()
    chunk = SeqChunk(prompt, 0, [3, 9, 4], logits_positions=list(range(PROMPT_LEN)))
    return pool, build_forward_batch([chunk], 8, 4, choose_shape([chunk]))


def _prompt_logits(arch: str, backend: str, scan_layers: bool):
    model = load_model(tiny_checkpoint(arch), dtype="float32", attention_backend=backend, scan_layers=scan_layers)
    pool, batch = _prompt_step(model.config, 2)
    forward, state = _forward(model)
    hlo = forward.lower(state, pool, batch).compile().as_text()
    return model, np.asarray(forward(state, pool, batch)[1])[:PROMPT_LEN], hlo


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_the_models_layer_matmuls_run_it_in_place_and_give_xlas_logits(scan_layers):
    """Qwen2 (biases on q/k/v): every layer matmul is a native call; in the scan no layer's weights are
    sliced out of their stack; the logits are the XLA matmuls' (`reference` backend) to f32 rounding."""
    model, ours, hlo = _prompt_logits("qwen2", "cpu", scan_layers)
    assert model.model.native_matmul
    cfg = model.config
    calls = hlo.count('custom_call_target="jaxpaged_matmul"')
    lm_head = not cfg.tie_word_embeddings   # an untied LM head is a plain [hidden, vocab] matmul too
    assert calls == len(NATIVE_MATMULS) * (1 if scan_layers else cfg.num_layers) + lm_head
    if scan_layers:   # a slice out of a [layers, ...] stack: f32[1, <the layer's shape>]
        sliced = re.findall(r"= f32\[1,([\d,]+)\]\S* dynamic-slice\(", hlo)
        assert sliced, "the scan slices its other per-layer arrays (norms, biases): the pattern must see them"
        weight_shapes = {",".join(map(str, layer_weight_shapes(cfg)[name])) for name in NATIVE_MATMULS}
        assert not weight_shapes & set(sliced), "a layer weight was copied out of its stack"
    _, ref, ref_hlo = _prompt_logits("qwen2", "reference", scan_layers)
    assert "jaxpaged_matmul" not in ref_hlo
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_a_steps_padding_tokens_are_not_multiplied():
    """The step's tokens come first and its padding after (ForwardBatch): the model hands the native
    matmul the token count, so a padding row leaves every layer as it came in (its embedding), while
    the XLA model computes it like any token. The tokens' hidden states are the same either way."""
    hidden, n = {}, PROMPT_LEN
    for backend in ("cpu", "reference"):
        model = load_model(tiny_checkpoint("llama"), dtype="float32", attention_backend=backend)
        pool, batch = _prompt_step(model.config, 3)
        graphdef, state = nnx.split(model.model)
        run = jax.jit(lambda state, pool, batch: nnx.merge(graphdef, state).hidden_states(pool, batch)[1])
        hidden[backend] = np.asarray(run(state, pool, batch))
        embedding = np.asarray(model.model.embed.get_value())[np.asarray(batch.input_ids)]
    assert hidden["cpu"].shape[0] > n, "the bucket must pad the prompt's tokens"
    np.testing.assert_array_equal(hidden["cpu"][n:], embedding[n:])
    assert not np.allclose(hidden["reference"][n:], embedding[n:])
    np.testing.assert_allclose(hidden["cpu"][:n], hidden["reference"][:n], rtol=0,
                               atol=1e-5 * np.abs(hidden["reference"][:n]).max())
