"""Each family's switches, read from its Hugging Face config into `ModelConfig` fields.

Every supported architecture is the same decoder with a few switches, so they all become one
`ModelConfig` (jaxpaged.models.config); this module says which switches each family sets:

- Llama, Mistral, Qwen2, Qwen3: q/k/v bias, q/k norm, sliding windows, head_dim, rope scaling.
- Phi-3: fused qkv and gate_up tensors in the checkpoint (split by the loader), long-rope
  scaling (short and long per-frequency factors), partial rotary dimensions.
- Gemma 2 / Gemma 3 (text): (1 + w) norms, norms after attention and after the MLP as well,
  the embedding scaled by sqrt(hidden), GeGLU, attention and final logit soft-capping,
  query_pre_attn_scalar, alternating sliding-window and global layers, a separate rope base
  for the local layers (Gemma 3).
- Gemma (1): the Gemma 2 switches without sandwich norms, soft-capping or sliding windows.
- Granite: scaled embedding, residual branches and logits, its own attention scale; Granite MoE the same
  with routed experts (and, GraniteMoeShared, an ungated shared MLP); Granite 4 (GraniteMoeHybrid) the same
  where every layer is attention (no Mamba layers), dense or not, with or without rope.
- OLMo 2 / OLMo 3: norms after attention and after the MLP only (no pre-norms), q/k norms over
  all heads at once, and (OLMo 3) sliding-window layers with their own rope.
- SmolLM3: layers without rope among the rotating ones (NoPE, `nope_layers`).
- EXAONE 4: OLMo 2's norms with per-head q/k norms, sliding-window layers, the global ones without rope.
- ERNIE 4.5: biases everywhere (`use_bias`), an interleaved rope (`rope_interleaved`: the loader reorders
  q/k's dims so that the model's rotate-half rope turns the same pairs); its MoE: softmax routing steered by a
  choice bias, ungated shared experts, dense layers outside moe_layer_start_index..end_index / interval.
- Mixtral, Qwen2-MoE, Qwen3-MoE: a routed mixture of experts in place of the MLP (top-k of
  `num_experts`, probabilities renormalized or not), Qwen2-MoE's shared expert with its
  sigmoid gate, and dense layers among the sparse ones (`dense_layers`).
- gpt-oss: experts with biases (router too) and a clamped SwiGLU, attention sinks (a learned
  logit per head in every softmax's denominator), alternating sliding / global layers, yarn.
- GLM-4 (GlmForCausalLM, and Glm4ForCausalLM with GLM-4's norms after attention and the MLP as well): an
  interleaved rope over half the head's dims, biased q/k/v, gate and up fused in the checkpoint.
- Seed-OSS: Llama's layer with biased q/k/v (and o where attention_out_bias); Ministral: Mistral's with
  sliding-window layers among full ones.
- Cohere (Command R, Aya) and Cohere2 (Command R7B, Command A): LayerNorms without a bias, attention and the
  MLP side by side on one normed input, an interleaved rope, scaled logits; Cohere2's sliding-window layers,
  its global ones without rope.
- MiniMax-M2: q/k norms over all heads at once, a partial rope, and DeepSeek-V3's sigmoid router (a choice
  bias, renormalized) without groups. OLMoE: the same q/k norms before Qwen3-MoE's softmax router. FlexOlmo:
  OLMo 2's layer with OLMoE's experts.
- StableLM: LayerNorms with biases, q/k/v bias where use_qkv_bias, a partial rope, and (use_parallel_residual)
  Cohere's parallel block. Nemotron: LayerNorms with biases that multiply by (1 + w), an ungated squared-ReLU
  MLP, a partial rope. Arcee (AFM): Llama's layer with an ungated squared-ReLU MLP.
- GPT-2, GPT-BigCode, OPT, GPT-J, GPT-NeoX, Phi, StarCoder2: their switches and names are
  `jaxpaged.models.gpt_families`'.
- DeepSeek-V2 / V3, GLM-4.7-Flash: multi-head latent attention (`kv_lora_rank`, jaxpaged.models.mla),
  and with GLM-4.5 their routers (`moe.Routing`: sigmoid scores with a correction bias, expert groups,
  a routed scaling factor), ungated shared experts and the first layers dense.
"""

from typing import Any

from jaxpaged.models import rope

GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"   # Granite 4: its attention-only checkpoints (no Mamba layers)
GRANITE_MOE = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", GRANITE_HYBRID)
ERNIE_MOE = "Ernie4_5_MoeForCausalLM"
MINIMAX_M2 = "MiniMaxM2ForCausalLM"
MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", ERNIE_MOE,
       MINIMAX_M2, "OlmoeForCausalLM", "FlexOlmoForCausalLM") + GRANITE_MOE
GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
GLM = ("GlmForCausalLM", "Glm4ForCausalLM")   # dense GLM-4: gate_up_proj fused in the checkpoint
COHERE = ("CohereForCausalLM", "Cohere2ForCausalLM")
# a family's fused linears: the checkpoint's tensor (its name in a layer) -> the Llama-style linears whose output
# rows it holds, in order (hf_names reads each part's rows from it; a LoRA adapter's B is split the same way)
_GATE_UP = {"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
FUSED_LINEARS = {"Phi3ForCausalLM": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                     **_GATE_UP},
                 **{arch: _GATE_UP for arch in GLM}}
OLMO = ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "FlexOlmoForCausalLM")   # (FlexOlmo: OLMo 2's layer, OLMoE's experts)
# multi-head latent attention (jaxpaged.models.mla), each with DeepSeek's mixture of experts
MLA = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
# DeepSeek-style mixtures: n_routed_experts, ungated shared experts, first_k_dense_replace, routed_scaling_factor
DEEPSEEK_MOE = MLA + ("Glm4MoeForCausalLM",)


def hf_get(hf_config: Any, name: str, default: Any = None) -> Any:
    """A config field, `default` where it is missing or None."""
    value = getattr(hf_config, name, default)
    return default if value is None else value


def sliding_windows(hf_config: Any, architecture: str, num_layers: int) -> tuple[int, ...]:
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return (0,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if architecture == "MistralForCausalLM" or not layer_types:
        return (int(window),) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in layer_types)


def moe_fields(hf_config: Any, architecture: str, num_layers: int) -> dict:
    if architecture in DEEPSEEK_MOE:
        return _deepseek_moe_fields(hf_config, architecture, num_layers)
    if architecture == ERNIE_MOE:
        if hf_get(hf_config, "use_bias", False):
            raise ValueError("Ernie4_5_MoeForCausalLM with use_bias=True (a biased LM head) is not supported; the "
                             "released ERNIE 4.5 MoE checkpoints have none")
        start, end = (int(hf_get(hf_config, name, default)) for name, default in
                      (("moe_layer_start_index", 0), ("moe_layer_end_index", -1)))
        interval, end = int(hf_get(hf_config, "moe_layer_interval", 1)), num_layers - 1 if end == -1 else end
        inter = int(hf_config.moe_intermediate_size)
        return dict(num_experts=int(hf_config.moe_num_experts), num_experts_per_tok=int(hf_config.moe_k),
                    moe_intermediate_size=inter, norm_topk_prob=True, router_choice_bias=True,
                    shared_expert_size=inter * int(hf_get(hf_config, "moe_num_shared_experts", 0)),
                    dense_layers=tuple(i for i in range(num_layers)
                                       if (i + 1) % interval or not start <= i <= end))
    if architecture not in MOE:
        return {}
    if architecture in ("OlmoeForCausalLM", "FlexOlmoForCausalLM"):   # softmax routing, renormalized or not
        return dict(num_experts=int(hf_config.num_experts), num_experts_per_tok=int(hf_config.num_experts_per_tok),
                    moe_intermediate_size=int(hf_config.intermediate_size),
                    norm_topk_prob=bool(hf_get(hf_config, "norm_topk_prob", False)))
    if architecture == MINIMAX_M2:   # sigmoid scores steered by a choice bias, the chosen ones renormalized
        return dict(num_experts=int(hf_config.num_local_experts),
                    num_experts_per_tok=int(hf_config.num_experts_per_tok),
                    moe_intermediate_size=int(hf_config.intermediate_size), norm_topk_prob=True,
                    router_scoring="sigmoid", router_choice_bias=True)
    if architecture == GRANITE_HYBRID and not hf_get(hf_config, "num_local_experts", 0):   # dense: the shared MLP
        return dict(intermediate_size=int(hf_config.shared_intermediate_size))
    if architecture in GRANITE_MOE:   # softmax over the top-k logits: the top-k probabilities renormalized
        return dict(num_experts=int(hf_config.num_local_experts),
                    num_experts_per_tok=int(hf_config.num_experts_per_tok),
                    moe_intermediate_size=int(hf_config.intermediate_size), norm_topk_prob=True,
                    shared_expert_size=int(hf_get(hf_config, "shared_intermediate_size", 0)))
    if architecture in ("MixtralForCausalLM", "GptOssForCausalLM"):
        gpt_oss = dict(moe_bias=True, swiglu_limit=float(hf_get(hf_config, "swiglu_limit", 7.0)),
                       swiglu_alpha=float(hf_get(hf_config, "swiglu_alpha", 1.702)))
        return dict(num_experts=int(hf_config.num_local_experts),
                    num_experts_per_tok=int(hf_config.num_experts_per_tok),
                    moe_intermediate_size=int(hf_config.intermediate_size), norm_topk_prob=True,
                    **(gpt_oss if architecture == "GptOssForCausalLM" else {}))
    step = int(hf_get(hf_config, "decoder_sparse_step", 1))
    only = set(hf_get(hf_config, "mlp_only_layers", []) or [])
    dense = tuple(i for i in range(num_layers) if i in only or step < 1 or (i + 1) % step)
    qwen2 = architecture == "Qwen2MoeForCausalLM"
    return dict(num_experts=int(hf_config.num_experts), num_experts_per_tok=int(hf_config.num_experts_per_tok),
                moe_intermediate_size=int(hf_config.moe_intermediate_size),
                norm_topk_prob=bool(hf_get(hf_config, "norm_topk_prob", False)),
                shared_expert_size=int(hf_get(hf_config, "shared_expert_intermediate_size", 0) or 0) if qwen2 else 0,
                shared_expert_gated=qwen2, dense_layers=dense)


def _deepseek_moe_fields(hf_config: Any, architecture: str, num_layers: int) -> dict:
    """DeepSeek-V2's softmax router (greedy, or the best experts of the best groups by their best expert),
    DeepSeek-V3's and GLM-4.5's sigmoid one (a correction bias steers the choice, groups scored by their two
    best); both scale the chosen weights by routed_scaling_factor."""
    experts = int(hf_get(hf_config, "n_routed_experts", 0))
    groups, topk_groups = int(hf_get(hf_config, "n_group", 1)), int(hf_get(hf_config, "topk_group", 1))
    if architecture == "DeepseekV2ForCausalLM":
        method = hf_get(hf_config, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported; supported: greedy, group_limited_greedy")
        if method == "greedy":
            groups = topk_groups = 1
        scoring, normalize, group_score = "softmax", False, "max"
    else:
        scoring, normalize, group_score = "sigmoid", bool(hf_get(hf_config, "norm_topk_prob", True)), "top2"
    if groups < 1 or experts % groups or not 1 <= topk_groups <= groups:
        raise ValueError(f"n_group ({groups}) must divide n_routed_experts ({experts}) and topk_group "
                         f"({topk_groups}) lie in [1, n_group]")
    kinds = getattr(hf_config, "mlp_layer_types", None)   # GLM-4.7-Flash: "dense" | "sparse" per layer
    first_dense = int(hf_get(hf_config, "first_k_dense_replace", 0))
    dense = (tuple(i for i, kind in enumerate(kinds) if kind != "sparse") if kinds
             else tuple(range(min(first_dense, num_layers))))
    return dict(num_experts=experts, num_experts_per_tok=int(hf_config.num_experts_per_tok),
                moe_intermediate_size=int(hf_config.moe_intermediate_size), norm_topk_prob=normalize,
                shared_expert_size=int(hf_config.moe_intermediate_size) * int(hf_get(hf_config, "n_shared_experts", 0)),
                dense_layers=dense, router_scoring=scoring, router_choice_bias=scoring == "sigmoid",
                router_groups=(groups, topk_groups),
                router_group_score=group_score,
                routed_scaling_factor=float(hf_get(hf_config, "routed_scaling_factor", 1.0)))


def mla_fields(hf_config: Any, architecture: str) -> dict:
    """Multi-head latent attention's sizes (jaxpaged.models.mla): the attention runs over one shared
    "KV head" of kv_lora_rank + qk_rope_head_dim dims (the compressed latent and the rotating key),
    which is what the KV pool holds."""
    if architecture not in MLA:
        return {}
    if hf_get(hf_config, "attention_bias", False):
        raise ValueError(f"{architecture} with attention_bias=True is not supported (no released checkpoint has it)")
    lora, rope_dim, nope = int(hf_config.kv_lora_rank), int(hf_config.qk_rope_head_dim), int(hf_config.qk_nope_head_dim)
    scale = (nope + rope_dim) ** -0.5 * rope.softmax_mscale(rope.rope_params(hf_config))
    return dict(kv_lora_rank=lora, q_lora_rank=int(hf_get(hf_config, "q_lora_rank", 0) or 0),
                qk_nope_head_dim=nope, v_head_dim=int(hf_config.v_head_dim), attn_scale=scale,
                head_dim=lora + rope_dim, rotary_dim=rope_dim, num_kv_heads=1,
                # DeepSeek-V2 always turns pairs (2i, 2i+1) (complex rotation); V3 and GLM where rope_interleave
                rope_interleaved=architecture == "DeepseekV2ForCausalLM" or bool(hf_get(hf_config, "rope_interleave",
                                                                                       True)))


def gemma_fields(hf_config: Any, architecture: str) -> dict:
    if architecture not in GEMMA:
        return {}
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported; jaxpaged runs "
                         "causal language models")
    gemma1 = architecture == "GemmaForCausalLM"
    return dict(norm_offset=1.0, embed_scale=float(hf_config.hidden_size) ** 0.5, sandwich_norms=not gemma1,
                attn_scale=float(hf_get(hf_config, "query_pre_attn_scalar", hf_config.head_dim)) ** -0.5,
                attn_softcap=float(hf_get(hf_config, "attn_logit_softcapping", 0.0)),
                final_softcap=float(hf_get(hf_config, "final_logit_softcapping", 0.0)),
                qk_norm=architecture == "Gemma3ForCausalLM")


def family_fields(hf_config: Any, architecture: str, num_layers: int) -> dict:
    """The switches of Granite, OLMo 2/3, EXAONE 4, ERNIE 4.5, SmolLM3, GLM-4 and 4.5, Seed-OSS, MiniMax-M2, Cohere
    and gpt-oss's attention (Gemma's, the experts' and latent attention's have their own readers)."""
    if architecture == GRANITE_HYBRID:
        kinds = sorted(set(getattr(hf_config, "layer_types", None) or ()) - {"attention", "full_attention"})
        if kinds:
            raise ValueError(f"{architecture} with layers of type {', '.join(map(repr, kinds))} (Granite 4's Mamba "
                             "layers) is not supported; its attention-only checkpoints are")
    if architecture in ("GraniteForCausalLM",) + GRANITE_MOE:
        rotates = architecture != GRANITE_HYBRID or hf_get(hf_config, "position_embedding_type", None) == "rope"
        return dict(nope_layers=() if rotates else tuple(range(num_layers)),
                    embed_scale=float(hf_get(hf_config, "embedding_multiplier", 1.0)),
                    input_embeds_scaled=True,
                    residual_scale=float(hf_get(hf_config, "residual_multiplier", 1.0)),
                    logits_scaling=float(hf_get(hf_config, "logits_scaling", 1.0)),
                    attn_scale=float(hf_get(hf_config, "attention_multiplier", 0.0)))
    if architecture in OLMO:
        return dict(pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_full=True)
    if architecture == "GptOssForCausalLM":
        return dict(attn_sinks=True)
    if architecture in GLM:   # biased q/k/v, not o; pairs (2i, 2i + 1) turn (over partial_rotary_factor's dims)
        return dict(o_bias=False, rope_interleaved=True, sandwich_norms=architecture == "Glm4ForCausalLM")
    if architecture == "SeedOssForCausalLM":
        return dict(o_bias=bool(hf_get(hf_config, "attention_out_bias", False)))
    if architecture in (MINIMAX_M2, "OlmoeForCausalLM"):
        if hf_get(hf_config, "clip_qkv", None) is not None:
            raise ValueError(f"{architecture} with clip_qkv set is not supported (the released checkpoints have none)")
        return dict(qk_norm=True, qk_norm_full=True)
    if architecture in COHERE:
        if hf_get(hf_config, "use_qk_norm", False):
            raise ValueError(f"{architecture} with use_qk_norm=True (Command R+'s per-head LayerNorms) is not "
                             "supported")
        return dict(layer_norm=True, parallel_block=True, rope_interleaved=True,
                    rms_norm_eps=float(hf_get(hf_config, "layer_norm_eps", 1e-5)),
                    logits_scaling=1.0 / float(hf_get(hf_config, "logit_scale", 1.0)),
                    # Cohere2: the global layers do not rotate
                    nope_layers=_global_layers(hf_config, num_layers) if architecture == "Cohere2ForCausalLM" else ())
    if architecture == "Glm4MoeForCausalLM":   # biased q/k/v (not o), per-head q/k norms where use_qk_norm
        return dict(o_bias=False, qk_norm=bool(hf_get(hf_config, "use_qk_norm", False)))
    if architecture in ("Ernie4_5ForCausalLM", ERNIE_MOE):
        bias = bool(hf_get(hf_config, "use_bias", False))
        return dict(rope_interleaved=True, qkv_bias=bias, o_bias=bias, mlp_bias=bias)
    if architecture == "Exaone4ForCausalLM":   # with sliding windows, the global layers do not rotate
        windowed = bool(getattr(hf_config, "sliding_window", None))
        return dict(pre_norms=False, sandwich_norms=True, qk_norm=True,
                    nope_layers=_global_layers(hf_config, num_layers) if windowed else ())
    if architecture == "StableLmForCausalLM":
        if hf_get(hf_config, "qk_layernorm", False):
            raise ValueError(f"{architecture} with qk_layernorm=True (StableLM 2 12B's per-head LayerNorms) is not "
                             "supported")
        bias = bool(hf_get(hf_config, "use_qkv_bias", False))
        return dict(layer_norm=True, norm_bias=True, rms_norm_eps=float(hf_get(hf_config, "layer_norm_eps", 1e-5)),
                    qkv_bias=bias, o_bias=False, parallel_block=bool(hf_get(hf_config, "use_parallel_residual", False)))
    if architecture == "NemotronForCausalLM":   # LayerNorm1P: x normed times (1 + w), plus b
        return dict(layer_norm=True, norm_bias=True, norm_offset=1.0, gated_mlp=False,
                    rms_norm_eps=float(hf_get(hf_config, "norm_eps", 1e-5)))
    if architecture == "ArceeForCausalLM":
        return dict(gated_mlp=False)
    if architecture == "SmolLM3ForCausalLM":
        uses_rope = hf_get(hf_config, "no_rope_layers", [1] * num_layers)   # transformers' name: 1 = rotates
        return dict(nope_layers=tuple(i for i, rotates in enumerate(uses_rope) if not rotates))
    return {}


def _global_layers(hf_config: Any, num_layers: int) -> tuple[int, ...]:
    """The layers that are not sliding-window ones (`layer_types`; all when it is missing)."""
    kinds = getattr(hf_config, "layer_types", None) or ["full_attention"] * num_layers
    return tuple(i for i, kind in enumerate(kinds) if kind != "sliding_attention")
