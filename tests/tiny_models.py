"""Tiny random Hugging Face checkpoints of each supported architecture, saved once per session.

Each config exercises that architecture's switches: GQA and MQA, an explicit head_dim,
q/k/v bias, q/k norm, a sliding window shorter than the test sequences, rope scaling.
"""

import atexit
import functools
import os
import shutil
import tempfile

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# the families beyond Llama's (phi3-longrope: long-rope scaling and a partial rotary, short and long prompts)
FAMILIES = ("phi3", "gemma", "gemma2", "gemma3", "granite", "olmo2", "olmo3", "smollm3", "mixtral", "qwen2_moe",
            "qwen3_moe", "gpt_oss", "exaone4", "ernie4_5", "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite",
            "granitemoe", "granitemoe_shared", "ernie4_5_moe", "glm", "glm4", "seed_oss", "minimax_m2", "ministral",
            "cohere", "cohere2", "olmoe", "granitemoehybrid", "granitemoehybrid_dense", "gpt2", "opt", "gpt_neox",
            "gptj", "phi", "starcoder2", "gpt_bigcode", "stablelm", "nemotron", "arcee",
            "falcon", "flex_olmo")
_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
            "gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3", "granite": "Granite", "olmo2": "Olmo2",
            "olmo3": "Olmo3", "smollm3": "SmolLM3", "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe",
            "qwen3_moe": "Qwen3Moe", "gpt_oss": "GptOss", "exaone4": "Exaone4",
            "ernie4_5": "Ernie4_5", "deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe",
            "glm4_moe_lite": "Glm4MoeLite", "granitemoe": "GraniteMoe", "granitemoe_shared": "GraniteMoeShared",
            "ernie4_5_moe": "Ernie4_5_Moe", "glm": "Glm", "glm4": "Glm4", "seed_oss": "SeedOss",
            "minimax_m2": "MiniMaxM2", "ministral": "Ministral", "cohere": "Cohere", "cohere2": "Cohere2",
            "olmoe": "Olmoe", "granitemoehybrid": "GraniteMoeHybrid", "granitemoehybrid_dense": "GraniteMoeHybrid",
            "gpt2": "GPT2", "opt": "OPT", "gpt_neox": "GPTNeoX", "gptj": "GPTJ", "phi": "Phi",
            "starcoder2": "Starcoder2", "gpt_bigcode": "GPTBigCode", "stablelm": "StableLm", "nemotron": "Nemotron",
            "arcee": "Arcee", "falcon": "Falcon", "flex_olmo": "FlexOlmo"}
_ROOT = tempfile.mkdtemp(prefix="jaxpaged-tiny-")   # this process's checkpoints, removed when it exits
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def scratch_folder(prefix: str) -> str:
    """A new empty folder for a test's files (adapters, converted models), removed with _ROOT."""
    return tempfile.mkdtemp(prefix=prefix, dir=_ROOT)


def _config(arch: str, **overrides):
    import transformers

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        rope = overrides.pop("rope", "llama3")
        rope_parameters = {
            "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            # dynamic NTK only acts past max_position_embeddings: keep it short so tests reach it
            "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        }[rope]
        if rope == "dynamic":
            common["max_position_embeddings"] = 32
        cfg = transformers.LlamaConfig(**{**common, "tie_word_embeddings": True, "rope_parameters": rope_parameters,
                                          **overrides})
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{**common, "num_key_value_heads": 1, "sliding_window": 12,
                                            "head_dim": 32, **overrides})
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": False, **overrides})
    elif arch == "qwen3":
        if overrides.pop("rope", None) == "yarn":   # Qwen's long-context setting: 4x over 32 original positions
            common.update(max_position_embeddings=128, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": True, **overrides})
    elif arch == "phi3":
        if overrides.pop("rope", None) == "longrope":   # 4 of 16 head dims rotate; long factors past 32 tokens
            # (Phi3Config's own original_max_position_embeddings, 4096 by default, overrides rope_parameters')
            common.update(max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 4.0, 8.0, 16.0]})
        cfg = transformers.Phi3Config(**{**common, "sliding_window": None, **overrides})
    elif arch in ("gemma2", "gemma3"):
        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        gemma = dict(head_dim=32, sliding_window=12, layer_types=layer_types, hidden_activation="gelu_pytorch_tanh")
        if arch == "gemma2":   # caps low enough to bite on these weights
            cfg = transformers.Gemma2Config(**{**common, **gemma, "query_pre_attn_scalar": 24,
                                               "attn_logit_softcapping": 4.0, "final_logit_softcapping": 8.0,
                                               **overrides})
        else:
            rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
            cfg = transformers.Gemma3TextConfig(**{**common, **gemma, "query_pre_attn_scalar": 32,
                                                   "rope_parameters": rope, **overrides})
            cfg.architectures = ["Gemma3ForCausalLM"]
    elif arch == "gemma":
        cfg = transformers.GemmaConfig(**{**common, "head_dim": 32, "hidden_act": "gelu_pytorch_tanh", **overrides})
    elif arch == "granite":   # multipliers far enough from 1 to matter
        cfg = transformers.GraniteConfig(**{**common, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                                            "attention_multiplier": 0.1, "logits_scaling": 2.5, **overrides})
    elif arch in ("granitemoe", "granitemoe_shared"):   # Granite's multipliers; experts (and a shared MLP)
        granite = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
                       logits_scaling=2.5, num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)
        if arch == "granitemoe":
            cfg = transformers.GraniteMoeConfig(**{**common, **granite, **overrides})
        else:
            cfg = transformers.GraniteMoeSharedConfig(**{**common, **granite, "shared_intermediate_size": 96,
                                                         **overrides})
    elif arch == "olmo2":
        cfg = transformers.Olmo2Config(**{**common, "tie_word_embeddings": False, **overrides})
    elif arch == "olmo3":   # layer 1 full attention with yarn, layers 0 and 2 a 12-token window with plain rope
        rope = {"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 32},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        cfg = transformers.Olmo3Config(**{**common, "max_position_embeddings": 128, "sliding_window": 12,
                                          "rope_parameters": rope,
                                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                          **overrides})
    elif arch == "exaone4":   # post-norms, per-head q/k norms, layer 1 global without rope, 0 and 2 windowed
        cfg = transformers.Exaone4Config(**{**common, "sliding_window": 12, "layer_types": [
            "sliding_attention", "full_attention", "sliding_attention"], **overrides})
    elif arch == "ernie4_5":   # an interleaved rope, biases on every projection
        cfg = transformers.Ernie4_5Config(**{**common, "head_dim": 16, "use_bias": True, **overrides})
    elif arch == "ernie4_5_moe":   # interleaved rope, softmax routing steered by a choice bias, a shared expert
        cfg = transformers.Ernie4_5_MoeConfig(**{**common, "head_dim": 16, "moe_num_experts": 8, "moe_k": 2,
                                                 "moe_intermediate_size": 48, "moe_num_shared_experts": 1,
                                                 "moe_layer_start_index": 1, "tie_word_embeddings": False,
                                                 **overrides})
    elif arch == "smollm3":   # layer 1 without rope (NoPE)
        cfg = transformers.SmolLM3Config(**{**common, "no_rope_layers": [1, 0, 1], **overrides})
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**{**common, "num_local_experts": 8, "num_experts_per_tok": 2,
                                            "tie_word_embeddings": False, **overrides})
    elif arch == "qwen2_moe":   # a shared expert, top-k not renormalized, layer 1 dense (unrolled layers)
        cfg = transformers.Qwen2MoeConfig(**{**common, "num_experts": 8, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96,
                                             "norm_topk_prob": False, "mlp_only_layers": [1], **overrides})
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**common, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 48, "norm_topk_prob": True,
                                             "tie_word_embeddings": True, **overrides})
    elif arch == "gpt_oss":   # sinks, biased router and experts, a clamp low enough to bite, yarn, windows
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        cfg = transformers.GptOssConfig(**{**common, "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                                           "intermediate_size": 64, "max_position_embeddings": 128,
                                           "sliding_window": 12, "swiglu_limit": 1.0, "rope_parameters": rope,
                                           "layer_types": ["sliding_attention", "full_attention",
                                                           "sliding_attention"], **overrides})
    elif arch in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):   # latent attention (v: 12 dims, not nope's 16)
        mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                   n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, tie_word_embeddings=False)
        if arch == "deepseek_v2":   # no query bottleneck (V2-Lite), softmax routing: both experts in the best group
            cfg = transformers.DeepseekV2Config(**{**common, **mla, "q_lora_rank": None, "n_group": 4,
                                                   "topk_group": 1, "topk_method": "group_limited_greedy",
                                                   "routed_scaling_factor": 1.5, "n_shared_experts": 1,
                                                   "first_k_dense_replace": 1, **overrides})
        elif arch == "deepseek_v3":   # sigmoid routing in groups, yarn with both mscales
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                    "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
            cfg = transformers.DeepseekV3Config(**{**common, **mla, "q_lora_rank": 24, "n_group": 4, "topk_group": 2,
                                                   "routed_scaling_factor": 2.5, "n_shared_experts": 2,
                                                   "first_k_dense_replace": 1, "max_position_embeddings": 128,
                                                   "rope_parameters": rope, **overrides})
        else:   # GLM-4.7-Flash: dense / sparse layers by name, no groups
            cfg = transformers.Glm4MoeLiteConfig(**{**common, **mla, "q_lora_rank": 24, "routed_scaling_factor": 1.8,
                                                    "mlp_layer_types": ["dense", "sparse", "sparse"], **overrides})
    elif arch == "glm4_moe":   # partial rotary, q/k/v bias, q/k norms, sigmoid routing in groups, layer 0 dense
        cfg = transformers.Glm4MoeConfig(**{**common, "head_dim": 32, "partial_rotary_factor": 0.5,
                                            "attention_bias": True, "use_qk_norm": True, "n_routed_experts": 8,
                                            "num_experts_per_tok": 2, "moe_intermediate_size": 48, "n_group": 2,
                                            "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 1.5,
                                            "first_k_dense_replace": 1, **overrides})
    elif arch in ("glm", "glm4"):   # an interleaved rope over half of an explicit head_dim, q/k/v bias
        half = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        cls = transformers.GlmConfig if arch == "glm" else transformers.Glm4Config
        cfg = cls(**{**common, "head_dim": 32, "attention_bias": True, "rope_parameters": half, **overrides})
    elif arch == "seed_oss":   # biases on q/k/v and o
        cfg = transformers.SeedOssConfig(**{**common, "head_dim": 32, "attention_bias": True,
                                            "attention_out_bias": True, **overrides})
    elif arch == "minimax_m2":   # q/k norms over all heads, a partial rope, sigmoid routing with a choice bias
        half = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        cfg = transformers.MiniMaxM2Config(**{**common, "head_dim": 32, "num_local_experts": 8,
                                              "num_experts_per_tok": 2, "intermediate_size": 48,
                                              "rope_parameters": half, **overrides})
    elif arch == "ministral":   # sliding-window layers among full ones (transformers needs head_dim given)
        cfg = transformers.MinistralConfig(**{**common, "head_dim": 16, "sliding_window": 12, "layer_types": [
            "sliding_attention", "full_attention", "sliding_attention"], **overrides})
    elif arch == "cohere":   # LayerNorms, the parallel block, an interleaved rope, biases, scaled logits
        cfg = transformers.CohereConfig(**{**common, "attention_bias": True, "logit_scale": 0.5, "layer_norm_eps": 1e-5,
                                           **overrides})
    elif arch in ("granitemoehybrid", "granitemoehybrid_dense"):   # Granite 4 with attention layers only
        experts = 0 if arch.endswith("dense") else 8   # the dense one without rope
        cfg = transformers.GraniteMoeHybridConfig(**{
            **common, "layer_types": ["attention"] * 3, "num_local_experts": experts, "num_experts_per_tok": 2,
            "intermediate_size": 48, "shared_intermediate_size": 96, "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5, "logits_scaling": 2.0, "attention_multiplier": 0.2,
            "position_embedding_type": None if experts == 0 else "rope", **overrides})
    elif arch == "olmoe":   # q/k norms over all heads, softmax routing without renormalization
        cfg = transformers.OlmoeConfig(**{**common, "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48,
                                          "norm_topk_prob": False, **overrides})
    elif arch == "cohere2":   # Cohere's with sliding-window layers and global ones without rope
        cfg = transformers.Cohere2Config(**{**common, "logit_scale": 0.25, "sliding_window": 12, "layer_types": [
            "sliding_attention", "full_attention", "sliding_attention"], **overrides})
    elif arch == "gpt2":   # learned positions, LayerNorms with biases, Conv1D weights, an ungated gelu_new MLP
        cfg = transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=3, n_head=4, n_inner=128, n_positions=512,
                                      bos_token_id=1, eos_token_id=2, **overrides)
    elif arch == "opt":   # GPT-2's with positions from row 2 of their table and a relu MLP
        cfg = transformers.OPTConfig(**{"vocab_size": 320, "hidden_size": 64, "word_embed_proj_dim": 64,
                                        "num_hidden_layers": 3, "num_attention_heads": 4, "ffn_dim": 128,
                                        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
                                        "pad_token_id": 0, **overrides})
    elif arch == "gpt_neox":   # a quarter of each head rotates; attention and the MLP side by side, each normed
        cfg = transformers.GPTNeoXConfig(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                         intermediate_size=128, max_position_embeddings=512, hidden_act="gelu",
                                         bos_token_id=1, eos_token_id=2, **overrides)
    elif arch == "gptj":   # an interleaved rope over 8 of 16 head dims, the parallel block, an LM head bias
        cfg = transformers.GPTJConfig(vocab_size=320, n_embd=64, n_layer=3, n_head=4, n_inner=128, n_positions=512,
                                      rotary_dim=8, bos_token_id=1, eos_token_id=2, **overrides)
    elif arch == "phi":   # a rotate-half rope over 8 of 16 head dims, the parallel block, an LM head bias
        cfg = transformers.PhiConfig(**{**common, "num_key_value_heads": 4, "partial_rotary_factor": 0.5,
                                        "layer_norm_eps": 1e-5, **overrides})
    elif arch == "starcoder2":   # Llama's layer with LayerNorms, biases, an ungated MLP, a sliding window
        cfg = transformers.Starcoder2Config(**{**common, "sliding_window": 12, "hidden_act": "gelu_pytorch_tanh",
                                               **overrides})
    elif arch == "gpt_bigcode":   # GPT-2's with one KV head (multi_query), nn.Linear weights, an untied head
        cfg = transformers.GPTBigCodeConfig(**{"vocab_size": 320, "n_embd": 64, "n_layer": 3, "n_head": 4,
                                               "n_inner": 128, "n_positions": 512, "bos_token_id": 1,
                                               "eos_token_id": 2, "tie_word_embeddings": False, **overrides})
    elif arch == "stablelm":   # LayerNorms with biases, q/k/v bias, a quarter of each head rotates, the parallel block
        cfg = transformers.StableLmConfig(**{**common, "use_qkv_bias": True, "use_parallel_residual": True,
                                             "layer_norm_eps": 1e-5, **overrides})
    elif arch == "nemotron":   # (1 + w) LayerNorms with biases, an ungated squared-ReLU MLP, half of each head rotates
        cfg = transformers.NemotronConfig(**{**common, "partial_rotary_factor": 0.5, "mlp_bias": True, **overrides})
    elif arch == "arcee":   # Llama's with an ungated squared-ReLU MLP
        cfg = transformers.ArceeConfig(**{**common, "hidden_act": "relu2", **overrides})
    elif arch == "flex_olmo":   # OLMo 2's norms after attention and the experts, OLMoE's softmax routing
        cfg = transformers.FlexOlmoConfig(**{**common, "num_experts": 8, "num_experts_per_tok": 2,
                                             "intermediate_size": 48, **overrides})
    elif arch == "falcon":   # Falcon-7B's: one KV head, attention and the MLP side by side on one LayerNorm
        cfg = transformers.FalconConfig(**{"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 3,
                                           "num_attention_heads": 4, "ffn_hidden_size": 128, "bias": True,
                                           "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 512,
                                           **overrides})
    else:
        raise ValueError(arch)
    return cfg


@functools.cache
def tiny_checkpoint(arch: str, head: str = "ForCausalLM", **overrides) -> str:
    """Path of a saved fp32 random checkpoint (weights scaled up so logits are far from uniform); `head`:
    the transformers class's suffix ("ForSequenceClassification": a classifier, with labels=(names...))."""
    import torch
    import transformers

    labels = overrides.pop("labels", None)   # a classifier's class names (a tuple, hashable for the cache)
    cfg = _config(arch, **overrides, **({"id2label": dict(enumerate(labels))} if labels else {}))
    cls = getattr(transformers, "GPT2LMHeadModel" if arch == "gpt2" and head == "ForCausalLM"
                  else f"{_CLASSES[arch]}{head}")
    if head != "ForCausalLM":
        cfg.architectures = None   # (gemma3's is set for its causal LM above) save_pretrained names the class
    torch.manual_seed(sum(map(ord, arch)))
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # DeepSeek-V3's choice bias: enough to change choices
                b.normal_(0.0, 0.1)
    suffix = "-".join(f"{k}={v}" for k, v in sorted(overrides.items())) + ("-".join(labels) if labels else "")
    path = os.path.join(_ROOT, f"{arch}{'' if head == 'ForCausalLM' else head}{suffix}")
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return path


_CORPUS = ["The capital of France is Paris.", "Hello world! How are you today?",
           "Paged attention keeps the KV cache in fixed-size blocks.", "naïve café, 東京 and emoji 🙂"] * 20


@functools.cache
def tiny_tokenizer():
    """A byte-level BPE tokenizer of 320 tokens: <pad>=0, <s>=1, </s>=2, then bytes and merges."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


@functools.cache
def hf_model(path: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path: str, token_ids: list[int]):
    """transformers' logits [len, vocab] (numpy) for one sequence."""
    import torch

    with torch.no_grad():
        out = hf_model(path)(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()
