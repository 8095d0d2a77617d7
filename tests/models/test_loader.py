"""Checkpoint loading: sharded safetensors, dtypes, and errors a user can act on."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxpaged.models.config import model_config_from_hf
from jaxpaged.models.loader import load_model
from tests.tiny_models import tiny_checkpoint


def copy_checkpoint(tmp_path, arch="llama"):
    dst = tmp_path / arch
    shutil.copytree(tiny_checkpoint(arch), dst)
    return dst


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    import torch
    import transformers

    src = tiny_checkpoint("qwen2")
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert os.path.exists(sharded / "model.safetensors.index.json")
    a = nnx.to_flat_state(nnx.state(load_model(src, dtype="float32").model))
    b = nnx.to_flat_state(nnx.state(load_model(str(sharded), dtype="float32").model))
    assert [path for path, _ in a] == [path for path, _ in b]
    for (path, value_a), (_, value_b) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(value_a[...]), np.asarray(value_b[...]), err_msg=str(path))


@pytest.mark.parametrize("dtype,expected", [("auto", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_dtype_casts_weights(dtype, expected):
    loaded = load_model(tiny_checkpoint("llama"), dtype=dtype)
    assert loaded.dtype == expected
    state = nnx.state(loaded.model)
    assert {str(v.dtype) for path, v in nnx.to_flat_state(state) if path != ("kv_scales",)} == {expected}
    assert state["kv_scales"].get_value().dtype == jnp.float32   # an fp8 pool's scales: always fp32


def test_bad_dtype_names_the_choices():
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model(tiny_checkpoint("llama"), dtype="int8")


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    path = copy_checkpoint(tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(str(path))


def test_wrong_shape_is_named(tmp_path):
    path = copy_checkpoint(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[8, 64\], expected \[32, 64\]"):
        load_model(str(path))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = copy_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MambaForCausalLM.*LlamaForCausalLM, MistralForCausalLM, "
                                         "Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(str(path))


def test_rope_scaling_types_are_read():
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                   intermediate_size=64, vocab_size=32,
                                   rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                   architectures=["LlamaForCausalLM"])
    ours = model_config_from_hf(cfg)
    assert ours.rope_type == "linear" and ours.rope_factor == 4.0
    base = 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16))
    np.testing.assert_allclose(ours.inv_freq(), base / 4.0, rtol=1e-6)
    cfg.rope_parameters = {"rope_type": "mrope", "factor": 2.0, "rope_theta": 10000.0}   # (Qwen2-VL)
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported"):
        model_config_from_hf(cfg)


@pytest.mark.parametrize("rope,max_model_len", [
    ({"rope_type": "default"}, 2048), ({"rope_type": "linear", "factor": 4.0}, 8192),
    ({"rope_type": "yarn", "factor": 4.0}, 8192),   # Qwen2.5's form: max_position_embeddings the original length
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096)])
def test_scaled_rope_lengthens_the_context_as_vllm_derives_it(rope, max_model_len):
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                                   vocab_size=32, max_position_embeddings=2048, architectures=["Qwen2ForCausalLM"],
                                   rope_parameters={"rope_theta": 10000.0, **rope})
    assert model_config_from_hf(cfg).max_model_len == max_model_len


def test_gemma3s_max_position_embeddings_is_already_its_scaled_length():
    import transformers

    cfg = transformers.Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, head_dim=16,
                                        intermediate_size=64, vocab_size=32, max_position_embeddings=2048,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})
    cfg.architectures = ["Gemma3ForCausalLM"]
    ours = model_config_from_hf(cfg)
    assert ours.rope_type == "linear" and ours.max_model_len == 2048   # as vLLM: not 8 x 2048


def test_command_r_plus_per_head_layer_norms_are_refused_by_name():
    import transformers

    cfg = transformers.CohereConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                                    vocab_size=32, use_qk_norm=True, architectures=["CohereForCausalLM"])
    with pytest.raises(ValueError, match="use_qk_norm=True"):
        model_config_from_hf(cfg)
    cfg.use_qk_norm = False
    ours = model_config_from_hf(cfg)
    assert ours.layer_norm and ours.parallel_block and ours.logits_scaling == 1.0 / cfg.logit_scale


def test_granite_4_mamba_layers_are_refused_by_name():
    import transformers

    cfg = transformers.GraniteMoeHybridConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                              intermediate_size=64, vocab_size=32, mamba_n_heads=4,
                                              layer_types=["linear_attention", "attention"],
                                              architectures=["GraniteMoeHybridForCausalLM"])
    with pytest.raises(ValueError, match="'linear_attention' \\(Granite 4's Mamba layers\\) is not supported"):
        model_config_from_hf(cfg)
