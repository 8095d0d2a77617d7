"""GPT-2, OPT, GPT-NeoX and the other LayerNorm families beyond what every family's tests check
(tests/models/test_llama_family.py and tests/engine/test_model_families.py run them against transformers):
their checkpoints as released (GPT-2's names without "transformer.", OPT's without "model.", NeoX's rope
buffers) load the same weights; NeoX's and StableLM's sequential blocks, GPT-BigCode without multi_query and
Falcon's variants match transformers; what they refuse."""

import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.config import model_config_from_hf
from jaxpaged.models.loader import load_model
from tests.tiny_models import hf_logits, scratch_folder, tiny_checkpoint


def _renamed(arch: str, rename, extra: dict) -> str:
    """The tiny checkpoint of `arch` saved again with its tensors renamed and `extra` tensors added."""
    from safetensors.numpy import load_file, save_file

    source = tiny_checkpoint(arch)
    folder = os.path.join(scratch_folder(f"{arch}-released-"), "model")
    shutil.copytree(source, folder)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    save_file({**{rename(k): v for k, v in tensors.items()}, **extra}, os.path.join(folder, "model.safetensors"))
    return folder


def _weights(path: str) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(load_model(path, dtype="float32").model))]


@pytest.mark.parametrize("arch,rename,extra", [
    # GPT-2 as on the hub: GPT2Model's names, and the causal-mask buffers old saves kept
    ("gpt2", lambda k: k.removeprefix("transformer."), {"h.0.attn.bias": np.ones((1, 1, 8, 8), np.float32)}),
    ("opt", lambda k: k.removeprefix("model."), {}),   # OPT as on the hub: OPTModel's names
    ("gpt_neox", lambda k: k, {"gpt_neox.layers.0.attention.rotary_emb.inv_freq": np.ones(2, np.float32)}),
])
def test_checkpoints_as_released_load_the_same_weights(arch, rename, extra):
    ours = _weights(tiny_checkpoint(arch))
    released = _weights(_renamed(arch, rename, extra))
    assert len(ours) == len(released)
    for a, b in zip(ours, released):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arch,overrides", [
    ("gpt_neox", {"use_parallel_residual": False}),   # one block after the other
    ("stablelm", {"use_parallel_residual": False}),
    ("gpt_bigcode", {"multi_query": False}),   # c_attn head by head, as NeoX's query_key_value
    # Falcon-40B's: two KV heads, each after its queries in query_key_value, and two norms (ln_attn, ln_mlp)
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1}),
    ("falcon", {"multi_query": False, "parallel_attn": False}),   # head by head, one block after the other
])
def test_variants_match_transformers(arch, overrides):
    path = tiny_checkpoint(arch, **overrides)
    llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
              compile_on_startup=False)
    prompt = np.random.default_rng(5).integers(3, 320, 19).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=6, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    ref = hf_logits(path, prompt + list(out.token_ids))
    ref_logprobs = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token == int(np.argmax(ref[len(prompt) - 1 + i]))
        assert abs(lp[token].logprob - ref_logprobs[len(prompt) - 1 + i, token]) < 2e-4
    if arch == "gpt_neox":
        with pytest.raises(ValueError, match="update_weights does not yet take GPTNeoXForCausalLM"):
            llm.update_weights({"gpt_neox.final_layer_norm.weight": np.ones(64, np.float32)})


@pytest.mark.parametrize("arch,overrides,match", [
    ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before=False"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim .32. other than hidden_size .64."),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ("phi", {"qk_layernorm": True}, "PhiForCausalLM with qk_layernorm=True"),
    ("stablelm", {"qk_layernorm": True}, "StableLmForCausalLM with qk_layernorm=True"),
])
def test_variants_it_does_not_run_are_refused_by_name(arch, overrides, match):
    from tests.tiny_models import _config

    cfg = _config(arch, **overrides)
    cfg.architectures = [{"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "phi": "PhiForCausalLM",
                          "stablelm": "StableLmForCausalLM"}[arch]]
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(cfg)


def test_learned_positions_bound_max_model_len():
    path = tiny_checkpoint("gpt2")   # 512 learned positions
    with pytest.raises(ValueError, match=r"max_model_len \(600\) is larger than the model's "
                                         r"max_position_embeddings \(512\)"):
        LLM(path, dtype="float32", max_model_len=600, num_gpu_blocks_override=16, compile_on_startup=False)


# released configs' own field names (as on the hub, trimmed) -> (heads, kv heads, head_dim, intermediate, rotary
# dims, parallel block, its two norms, max_model_len)
RELEASED_CONFIGS = {
    "pythia-70m": (dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=512,
                        num_attention_heads=8, num_hidden_layers=6, intermediate_size=2048, rotary_pct=0.25,
                        rotary_emb_base=10000, use_parallel_residual=True, vocab_size=50304, hidden_act="gelu"),
                   (8, 8, 64, 2048, 16, True, True, 2048)),
    "falcon-40b": (dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=8192, multi_query=True,
                        new_decoder_architecture=True, num_attention_heads=128, num_hidden_layers=60, num_kv_heads=8,
                        parallel_attn=True, vocab_size=65024),
                   (128, 8, 64, 32768, 0, True, True, 2048)),
    "gpt2": (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_ctx=1024, n_embd=768, n_head=12, n_layer=12,
                  n_positions=1024, vocab_size=50257),
             (12, 12, 64, 3072, 0, False, False, 1024)),
    "gpt-j-6b": (dict(model_type="gptj", architectures=["GPTJForCausalLM"], n_embd=4096, n_head=16, n_layer=28,
                      n_positions=2048, rotary_dim=64, vocab_size=50400),
                 (16, 16, 256, 16384, 64, True, False, 2048)),
    "starcoderbase-1b": (dict(model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"], n_embd=2048,
                              n_head=16, n_layer=24, n_positions=8192, multi_query=True, vocab_size=49152),
                         (16, 1, 128, 8192, 0, False, False, 8192)),
}


@pytest.mark.parametrize("name", RELEASED_CONFIGS)
def test_released_configs_are_read_by_their_own_field_names(name):
    import transformers

    fields, want = RELEASED_CONFIGS[name]
    cfg = model_config_from_hf(transformers.CONFIG_MAPPING[fields["model_type"]](
        **{k: v for k, v in fields.items() if k != "model_type"}))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rotary_dim, cfg.parallel_block,
            cfg.parallel_mlp_norm, cfg.max_model_len) == want
