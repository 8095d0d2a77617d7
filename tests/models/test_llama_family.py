"""Our Flax models against transformers' PyTorch forward on tiny random checkpoints (fp32), every family."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.models.loader import load_model
from jaxpaged.runner.batch_builder import BatchShape, SeqChunk, choose_shape
from tests.forward_batch import build_forward_batch
from jaxpaged.kernels import kv_pool_shape
from tests.tiny_models import ARCHITECTURES, FAMILIES, hf_logits, tiny_checkpoint

ALL = ARCHITECTURES + FAMILIES

NUM_BLOCKS = 48
# One pool and three step shapes for every test of an architecture (its forward compiles three times):
# a prompt step with one logits row, the same with a row per token, and a decode step.
BLOCK_SIZE = 8
PROMPT_STEP = BatchShape(num_tokens=64, num_seqs=4, num_logits=4, q_tile=16)
EVERY_ROW_STEP = BatchShape(num_tokens=64, num_seqs=4, num_logits=64, q_tile=16)


@functools.cache
def loaded(arch: str, **overrides):
    path = tiny_checkpoint(arch, **overrides)
    model = load_model(path, dtype="float32")
    graphdef, state = nnx.split(model.model)

    @functools.partial(jax.jit, donate_argnums=1)
    def forward(state, kv_pool, batch):
        return nnx.merge(graphdef, state)(kv_pool, batch)

    return path, model.config, functools.partial(forward, state)


def empty_pool(cfg):
    return jnp.zeros(kv_pool_shape(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim),
                     jnp.float32)


def assert_close(ours, ref):
    scale = np.abs(ref).max()
    err = np.abs(np.asarray(ours) - ref).max()
    assert err < 1e-4 * scale, f"max abs error {err} vs largest logit {scale}"


def scattered_blocks(rng, n):
    """n distinct block ids, shuffled over the pool (block 0 is the null block)."""
    return list(rng.permutation(np.arange(1, NUM_BLOCKS))[:n])


@pytest.mark.parametrize("arch,rope", [(a, None) for a in ALL] + [("llama", "linear"), ("llama", "dynamic"),
                                                                   ("phi3", "longrope"), ("qwen3", "yarn")])
def test_whole_prompt_logits_match_transformers(arch, rope):
    """40-token prompts; the dynamic-NTK variant's max_position_embeddings is 32, so its scaling is active
    (yarn's original length is 32 too, though it scales at every length)."""
    path, cfg, forward = loaded(arch, **({"rope": rope} if rope else {}))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, 40).tolist()
    chunk = SeqChunk(tokens, 0, scattered_blocks(rng, 5), logits_positions=list(range(len(tokens))))
    _, logits = forward(empty_pool(cfg), build_forward_batch([chunk], BLOCK_SIZE, 8, EVERY_ROW_STEP))
    assert_close(np.asarray(logits)[:len(tokens)], hf_logits(path, tokens))


# every block boundary case on the Llama family (a prompt ending on a block, just past one, and just
# before one, whose decoding crosses it); one (just past a block) on the others
@pytest.mark.parametrize("arch,prompt_len", [(a, n) for a in ARCHITECTURES for n in (16, 17, 23)]
                         + [(a, 17) for a in FAMILIES])
def test_incremental_decoding_through_scattered_pages(arch, prompt_len):
    """Prompt, then one token at a time, on blocks of 8 scattered over the pool."""
    path, cfg, forward = loaded(arch)
    rng = np.random.default_rng(prompt_len)
    num_decode = 6
    tokens = rng.integers(3, cfg.vocab_size, prompt_len + num_decode).tolist()
    blocks = scattered_blocks(rng, -(-(prompt_len + num_decode) // BLOCK_SIZE))
    max_blocks = 8
    pool = empty_pool(cfg)
    prompt = SeqChunk(tokens[:prompt_len], 0, blocks, logits_positions=[prompt_len - 1])
    pool, logits = forward(pool, build_forward_batch([prompt], BLOCK_SIZE, max_blocks, PROMPT_STEP))
    got = [np.asarray(logits)[0]]
    for pos in range(prompt_len, prompt_len + num_decode - 1):
        step = SeqChunk([tokens[pos]], pos, blocks, logits_positions=[0])
        pool, logits = forward(pool, build_forward_batch([step], BLOCK_SIZE, max_blocks, choose_shape([step])))
        got.append(np.asarray(logits)[0])
    ref = hf_logits(path, tokens[:prompt_len + num_decode - 1])[prompt_len - 1:]
    assert_close(np.stack(got), ref)


@pytest.mark.parametrize("arch", ALL)
def test_mixed_batch_of_prefills_chunks_and_decodes(arch):
    """One step mixing a fresh prompt, a prompt chunk on top of cached tokens and two decodes."""
    path, cfg, forward = loaded(arch)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (30, 21, 9, 14)]
    cached = [0, 13, 8, 13]   # tokens already in the pool before the mixed step
    free = iter(scattered_blocks(rng, NUM_BLOCKS - 1))
    tables = [[next(free) for _ in range(-(-len(s) // BLOCK_SIZE))] for s in seqs]
    pool = empty_pool(cfg)
    first = [SeqChunk(s[:c], 0, t) for s, c, t in zip(seqs, cached, tables) if c]
    pool, _ = forward(pool, build_forward_batch(first, BLOCK_SIZE, 8, PROMPT_STEP))
    mixed = [SeqChunk(s[c:], c, t, logits_positions=list(range(len(s) - c))) for s, c, t in zip(seqs, cached, tables)]
    _, logits = forward(pool, build_forward_batch(mixed, BLOCK_SIZE, 8, EVERY_ROW_STEP))
    logits = np.asarray(logits)
    row = 0
    for s, c in zip(seqs, cached):
        n = len(s) - c
        assert_close(logits[row:row + n], hf_logits(path, s)[c:])
        row += n


@pytest.mark.parametrize("length", [20, 40])
def test_longrope_takes_its_long_factors_past_the_original_length(length):
    """Phi-3's long-rope: short factors up to original_max_position_embeddings (32), long ones past it,
    on a partial rotary (half of each head rotates), as transformers computes a whole prompt."""
    path, cfg, forward = loaded("phi3", rope="longrope")
    assert cfg.rope_type == "longrope" and cfg.rotary_dim == cfg.head_dim // 2
    rng = np.random.default_rng(length)
    tokens = rng.integers(3, cfg.vocab_size, length).tolist()
    chunk = SeqChunk(tokens, 0, scattered_blocks(rng, 5), logits_positions=list(range(length)))
    _, logits = forward(empty_pool(cfg), build_forward_batch([chunk], BLOCK_SIZE, 8, EVERY_ROW_STEP))
    assert_close(np.asarray(logits)[:length], hf_logits(path, tokens))


def test_granite_moe_reads_its_released_tensor_names():
    """Granite MoE's hub checkpoints name their experts block_sparse_moe.input_linear / output_linear and their
    router router.layer (transformers 5 renames them as it loads): read under those names too."""
    import os
    import shutil

    from safetensors.numpy import load_file, save_file
    from tests.tiny_models import scratch_folder

    path = tiny_checkpoint("granitemoe_shared")
    released = scratch_folder("granitemoe-released-")
    shutil.copytree(path, released, dirs_exist_ok=True)
    renames = {"experts.gate_up_proj": "input_linear.weight", "experts.down_proj": "output_linear.weight",
               "router.weight": "router.layer.weight"}
    tensors = {}
    for name, w in load_file(os.path.join(path, "model.safetensors")).items():
        for ours, theirs in renames.items():
            name = name.replace(f"block_sparse_moe.{ours}", f"block_sparse_moe.{theirs}")
        tensors[name] = np.ascontiguousarray(w)
    assert any("input_linear" in name for name in tensors) and any("router.layer" in name for name in tensors)
    save_file(tensors, os.path.join(released, "model.safetensors"), metadata={"format": "pt"})
    from tests.models.test_quantization import forward_logits
    tokens = np.random.default_rng(9).integers(3, 320, 30).tolist()
    assert_close(forward_logits(released, tokens)[0], hf_logits(path, tokens))
