"""The model's own config: what the Flax model needs, read once from a Hugging Face config.

Every supported architecture is the same decoder with a few switches, so they all become one
`ModelConfig`; which switches each family sets is `jaxpaged.models.families`' to say.

Rope types and their fields are read by `jaxpaged.models.rope`.
"""

import dataclasses
from typing import Any

import numpy as np

from jaxpaged.models import families, gpt_families, rope
from jaxpaged.models.families import hf_get as _get
from jaxpaged.models.vision_language import VISION_LANGUAGE_ARCHITECTURES, language_model_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GemmaForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "SmolLM3ForCausalLM",
    "GptOssForCausalLM",
    "Exaone4ForCausalLM",
    "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "GlmForCausalLM",
    "Glm4ForCausalLM",
    "SeedOssForCausalLM",
    "MiniMaxM2ForCausalLM",
    "MinistralForCausalLM",
    "CohereForCausalLM",
    "OlmoeForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "Cohere2ForCausalLM",
    "StableLmForCausalLM",
    "NemotronForCausalLM",
    "ArceeForCausalLM",
    "FlexOlmoForCausalLM",
) + gpt_families.ARCHITECTURES
# A bare transformer without its LM head (an embedding checkpoint: e5-mistral's MistralModel, weights
# without the "model." prefix) runs as its *ForCausalLM family, the input embedding standing in for
# the head, under the pooling runner only (pooling_params.resolve_runner).
BASE_MODEL_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                            "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
# A sequence classifier (a reward model, a cross-encoder reranker: transformers' *ForSequenceClassification)
# runs as its *ForCausalLM family, pooling runner only; its `score` head [num_labels, hidden] reads the
# last token's final-normed hidden state (ModelConfig.num_labels > 0).
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def causal_architecture(architecture: str | None) -> str | None:
    """The *ForCausalLM family that runs `architecture` (itself, or a bare model's or a classifier's)."""
    if architecture in BASE_MODEL_ARCHITECTURES:
        return BASE_MODEL_ARCHITECTURES[architecture]
    if architecture and architecture.endswith(CLASSIFIER_SUFFIX):
        causal = architecture[:-len(CLASSIFIER_SUFFIX)] + "ForCausalLM"
        return gpt_families.GPT2 if causal == "GPT2ForCausalLM" else causal   # (GPT-2's LM: GPT2LMHeadModel)
    return architecture


def is_classifier(hf_config) -> bool:
    architectures = getattr(hf_config, "architectures", None) or []
    return bool(architectures) and architectures[0].endswith(CLASSIFIER_SUFFIX)


# the language models of Qwen2-VL and Qwen2.5-VL: M-RoPE (ModelConfig.mrope_section)
MROPE_TEXT_MODELS = ("qwen2_vl_text", "qwen2_5_vl_text")
# transformers' names -> ours (jaxpaged.models.moe.activation): gelu is the exact one, the others its tanh form
# (quick_gelu: CLIP's vision tower)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu": "relu", "relu2": "relu2",
               "quick_gelu": "quick_gelu"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int, ...]   # per layer; 0 = full attention
    rope_theta: float
    rope_type: str
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 0
    # llama.cpp's per-frequency divisors [head_dim // 2] (a GGUF file's rope_freqs.weight); () = none
    rope_freq_factors: tuple[float, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"          # "silu" (SwiGLU) | "gelu_tanh" (GeGLU) | "gelu" | "relu" | "relu2" (squared)
    rotary_dim: int = 0               # leading dims of each head that rotate (partial rotary); 0 = all
    # longrope (Phi-3): per-frequency divisors [rotary_dim // 2], long ones once a sequence outgrows
    # rope_original_max_positions, and the factor cos and sin are multiplied by
    rope_short_factors: tuple[float, ...] = ()
    rope_long_factors: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0
    # Gemma 3: the rope base of the sliding-window (local) layers, 0 = every layer uses rope_theta
    local_rope_theta: float = 0.0
    # Qwen2-VL, Qwen2.5-VL: M-RoPE's sections of the head_dim // 2 frequencies (time, height, width), turned by
    # a step's mrope positions (ForwardBatch.mrope_positions: an engine that runs their images); () = none
    mrope_section: tuple[int, ...] = ()
    # Gemma: norms multiply by (1 + w), the embedding by sqrt(hidden), and each block's output is
    # normed before the residual add (sandwich norms)
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    # the scale applies to given prompt embeddings too (Granite's embedding_multiplier, after the lookup in
    # transformers), not only to the lookup (Gemma's, inside its embedding module)
    input_embeds_scaled: bool = False
    sandwich_norms: bool = False
    attn_scale: float = 0.0           # softmax scale; 0 = head_dim ** -0.5
    # OLMo 2/3: no norm before attention or the MLP (no input_norm / post_norm), the sandwich norms after them
    pre_norms: bool = True
    qk_norm_full: bool = False        # q/k norms over all heads' dims at once ([q_size], [kv_size]: OLMo)
    residual_scale: float = 1.0       # Granite: each block's output times this before the residual add
    logits_scaling: float = 1.0       # Granite: the output logits divided by this
    nope_layers: tuple[int, ...] = () # SmolLM3: the layers whose q/k do not rotate
    rope_interleaved: bool = False    # ERNIE: rope turns dims (2i, 2i+1), read as rotate-half (hf_names.hf_reader)
    # Cohere: mean-centred LayerNorms without a bias (eps in rms_norm_eps), and attention and the MLP side by side
    # on one normed input (no post_norm)
    layer_norm: bool = False
    parallel_block: bool = False
    # GPT-2's lineage (jaxpaged.models.gpt_families), StableLM, Nemotron, Arcee: LayerNorms with a bias, an MLP
    # without a gate (up, activation, down), learned positions (a table's rows position_offset + position added to
    # the embedding), NeoX's and Falcon-40B's parallel block whose MLP reads its own norm (post_norm) of the
    # layer's input, and Phi's and GPT-J's LM head with a bias
    norm_bias: bool = False
    gated_mlp: bool = True
    learned_positions: bool = False
    position_offset: int = 0
    parallel_mlp_norm: bool = False
    lm_head_bias: bool = False
    attn_sinks: bool = False          # gpt-oss: a learned logit per head joins each softmax's denominator
    # yarn: beta_fast / beta_slow (the ramp's ends, in rotations over the original length), truncate
    rope_yarn_betas: tuple[float, float] = (32.0, 1.0)
    rope_yarn_truncate: bool = True
    attn_softcap: float = 0.0         # attention logits -> cap * tanh(logits / cap); 0 = off
    final_softcap: float = 0.0        # the same on the output logits
    # mixture of experts: 0 experts = a dense MLP in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False      # renormalize the top-k probabilities to sum to 1
    shared_expert_size: int = 0       # Qwen2-MoE, DeepSeek: a dense expert (or several fused) every token takes
    shared_expert_gated: bool = False # Qwen2-MoE: the shared expert's output times a sigmoid gate
    # the router (jaxpaged.models.moe.Routing): "softmax" | "sigmoid" scores (DeepSeek-V3, GLM-4.5: plus a
    # correction bias that steers the choice only), (groups, groups kept) and how a group is scored ("max" |
    # "top2"), and the factor the chosen weights are scaled by
    router_scoring: str = "softmax"
    router_groups: tuple[int, int] = (1, 1)
    router_group_score: str = "max"
    routed_scaling_factor: float = 1.0
    # a bias added to the scores the choice is made on, not to the weights (e_score_correction_bias: DeepSeek-V3,
    # GLM-4.5, ERNIE 4.5 MoE)
    router_choice_bias: bool = False
    dense_layers: tuple[int, ...] = ()   # layers of an MoE model with a dense MLP (intermediate_size) instead
    moe_bias: bool = False            # gpt-oss: the router and each expert's projections add biases
    # gpt-oss's clamped SwiGLU in the experts: gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha *
    # gate); 0 = the plain gated MLP (hidden_act)
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    num_labels: int = 0               # a sequence classifier's classes (its `score` head's rows); 0 = none
    # multi-head latent attention (DeepSeek-V2/V3, jaxpaged.models.mla); 0 = none. With it head_dim is
    # kv_lora_rank + rotary_dim (the latent and the rotating key: what the pool holds) and num_kv_heads 1
    kv_lora_rank: int = 0
    q_lora_rank: int = 0              # queries through a low-rank, normed bottleneck; 0 = one projection
    qk_nope_head_dim: int = 0         # each query head's dims that do not rotate (the rest: rotary_dim)
    v_head_dim: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_act(self) -> str | tuple:
        """The experts' gated activation (jaxpaged.models.moe): hidden_act, or gpt-oss's clamped SwiGLU."""
        return ("swiglu_clamped", self.swiglu_limit, self.swiglu_alpha) if self.swiglu_limit else self.hidden_act

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @property
    def uniform_layers(self) -> bool:
        """Every layer has the same weights' shapes (a scanned stack needs it)."""
        return not (self.is_moe and self.dense_layers)

    @property
    def rope_layers(self) -> tuple[bool, ...]:
        """Per layer: its q/k rotate (all but SmolLM3's NoPE layers)."""
        return tuple(i not in self.nope_layers for i in range(self.num_layers))

    @property
    def rotates(self) -> bool:
        """Some layer's q/k rotate (not GPT-2's or OPT's: learned positions, no rope)."""
        return len(self.nope_layers) < self.num_layers

    @property
    def local_rope_layers(self) -> tuple[bool, ...]:
        """Per layer: rotates with local_rope_theta (Gemma 3's sliding-window layers)."""
        return tuple(bool(self.local_rope_theta) and w > 0 for w in self.sliding_windows)

    def num_params(self) -> int:
        """Parameters that take part in a token's matmuls (for FLOP counts, the experts it is routed to
        only): 2 x this per token."""
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.is_mla:   # the query's projections, the latent's, then the latent's two per head and o_proj
            qk_dim = self.qk_nope_head_dim + self.rotary_dim
            q = (self.q_lora_rank * (self.hidden_size + self.num_heads * qk_dim) if self.q_lora_rank
                 else self.hidden_size * self.num_heads * qk_dim)
            per_head = (self.kv_lora_rank * (self.qk_nope_head_dim + self.v_head_dim)
                        + self.v_head_dim * self.hidden_size)
            attention = q + self.hidden_size * self.head_dim + self.num_heads * per_head
        dense = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        routed = 3 * self.hidden_size * (self.num_experts_per_tok * self.moe_intermediate_size
                                         + self.shared_expert_size) + self.hidden_size * self.num_experts
        mlp = sum(routed if self.is_moe_layer(i) else dense for i in range(self.num_layers))
        return self.num_layers * attention + mlp + self.hidden_size * self.vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model takes, as vLLM derives it: max_position_embeddings, times the
        rope's factor for linear and dynamic scaling, the original length times the factor for yarn
        (Qwen's long-context setting keeps max_position_embeddings at the original length); Gemma 3's
        max_position_embeddings is already the scaled length."""
        if self.architecture == "Gemma3ForCausalLM":
            return self.max_position_embeddings
        if self.rope_type == "yarn":
            return int(self.rope_original_max_positions * self.rope_factor)
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.rope_factor)
        return self.max_position_embeddings

    @property
    def rope_switch_len(self) -> int:
        """The sequence length past which LongRoPE takes its long factors (0: the rope does not switch).
        transformers recomputes a sequence's whole cache with the long factors when it grows past it;
        the scheduler does the same (Scheduler: a request outgrowing its rope is recomputed)."""
        return self.rope_original_max_positions if self.rope_type == "longrope" else 0

    def inv_freq(self, long: bool = False, local: bool = False) -> np.ndarray:
        """Rotary inverse frequencies f32[rotary_dim // 2] (jaxpaged.models.rope.inv_freq)."""
        return rope.inv_freq(self, long, local)


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """Read a transformers config (a vision-language model's: its language model's); raises ValueError for an
    architecture or feature we don't run."""
    hf_config = language_model_config(hf_config)
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    classifier = is_classifier(hf_config)
    # no LM head in a bare model or a classifier: the input embedding stands in (its logits are not used)
    headless = classifier or architecture in BASE_MODEL_ARCHITECTURES
    given, architecture = architecture, causal_architecture(architecture)
    if architecture in gpt_families.ARCHITECTURES:   # their own field names, read as Llama's
        hf_config = gpt_families.llama_config(hf_config, architecture)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {given!r} is not supported; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES + tuple(BASE_MODEL_ARCHITECTURES))}, the "
                         f"{CLASSIFIER_SUFFIX} of each *ForCausalLM, and the language model (text only) of "
                         f"{', '.join(VISION_LANGUAGE_ARCHITECTURES)}")
    num_labels = int(getattr(hf_config, "num_labels", 0) or 0) if classifier else 0
    if classifier and num_labels < 1:
        raise ValueError(f"{given} needs num_labels >= 1 in its config (id2label), got {num_labels}")
    act_field = "hidden_activation" if architecture in families.GEMMA[1:] else "hidden_act"
    act = _get(hf_config, act_field, "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{act_field} {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    num_heads = hf_config.num_attention_heads
    head_dim = _get(hf_config, "head_dim", hf_config.hidden_size // num_heads)
    rope_cfg = rope.rope_params(hf_config)
    partial = float(rope_cfg.get("partial_rotary_factor", _get(hf_config, "partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of head_dim {head_dim}; "
                         "it must give an even number in (0, head_dim]")
    # Set by the GGUF loader; the factors compose with linear scaling as in llama.cpp, but
    # llama3 would scale twice and dynamic NTK recomputes the frequencies without them.
    freq_factors = tuple(float(f) for f in (getattr(hf_config, "rope_freq_factors", None) or ()))
    if freq_factors and rope_cfg["rope_type"] not in ("default", "linear"):
        raise ValueError(f"rope_freq_factors (a GGUF file's rope_freqs.weight) cannot be combined with "
                         f"rope_type {rope_cfg['rope_type']!r}; supported with them: default, linear")
    num_layers = hf_config.num_hidden_layers
    max_pos = _get(hf_config, "max_position_embeddings", 2048)
    eos = _get(hf_config, "eos_token_id", ())
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    attention_bias = bool(_get(hf_config, "attention_bias", False))
    if architecture == "Qwen2MoeForCausalLM":
        qkv_bias, o_bias = bool(_get(hf_config, "qkv_bias", True)), False
    elif architecture == "Qwen2ForCausalLM":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias, o_bias = attention_bias, attention_bias
    local_theta = rope.local_rope_theta(hf_config)
    if rope_cfg["rope_type"] == "default" and local_theta == float(rope_cfg["rope_theta"]):
        local_theta = 0.0   # the local layers rotate as the others do
    mrope_section = ()
    if getattr(hf_config, "model_type", None) in MROPE_TEXT_MODELS:   # (transformers' default sections)
        mrope_section = tuple(int(n) for n in rope_cfg.get("mrope_section") or (16, 24, 24))
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"rope_parameters mrope_section {list(mrope_section)} must sum to head_dim / 2 = "
                             f"{rotary_dim // 2}")
    fields = dict(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_get(hf_config, "num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=headless or bool(_get(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(_get(hf_config, "mlp_bias", False)),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_windows=families.sliding_windows(hf_config, architecture, num_layers),
        rope_theta=float(rope_cfg["rope_theta"]),
        rope_type=rope_cfg["rope_type"],
        rope_factor=float(rope_cfg.get("factor", 1.0) or 1.0),
        rope_low_freq_factor=float(rope_cfg.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope_cfg.get("high_freq_factor", 4.0)),
        rope_original_max_positions=int(rope_cfg.get("original_max_position_embeddings", max_pos)),
        local_rope_theta=local_theta,
        mrope_section=mrope_section,
        rope_freq_factors=freq_factors,
        bos_token_id=_get(hf_config, "bos_token_id", None),
        eos_token_ids=tuple(int(e) for e in eos_ids if e is not None),
        hidden_act=ACTIVATIONS[act],
        rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
        num_labels=num_labels,
    )
    if rope_cfg["rope_type"] == "longrope":
        fields.update(rope.longrope_fields(hf_config, rope_cfg, max_pos, rotary_dim))
    elif rope_cfg["rope_type"] == "yarn":
        fields.update(rope.yarn_fields(hf_config, rope_cfg, max_pos))
    fields.update(families.moe_fields(hf_config, architecture, num_layers))
    fields.update(families.gemma_fields(hf_config, architecture))
    fields.update(families.family_fields(hf_config, architecture, num_layers))
    if architecture in gpt_families.ARCHITECTURES:
        fields.update(gpt_families.family_fields(hf_config, architecture, num_layers))
    fields.update(families.mla_fields(hf_config, architecture))
    return ModelConfig(**fields)
