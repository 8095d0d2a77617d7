"""The model's own config: what the Flax model needs, read once from a Hugging Face config.

Every supported architecture is the same pre-norm decoder with a few switches, so they all
become one `ModelConfig`:

- Llama, Mistral, Qwen2, Qwen3: q/k/v bias, q/k norm, sliding windows, head_dim, rope scaling.
- Phi-3: fused qkv and gate_up tensors in the checkpoint (split by the loader), long-rope
  scaling (short and long per-frequency factors), partial rotary dimensions.
- Gemma 2 / Gemma 3 (text): (1 + w) norms, norms after attention and after the MLP as well,
  the embedding scaled by sqrt(hidden), GeGLU, attention and final logit soft-capping,
  query_pre_attn_scalar, alternating sliding-window and global layers, a separate rope base
  for the local layers (Gemma 3).
- Mixtral, Qwen2-MoE, Qwen3-MoE: a routed mixture of experts in place of the MLP (top-k of
  `num_experts`, probabilities renormalized or not), Qwen2-MoE's shared expert with its
  sigmoid gate, and dense layers among the sparse ones (`dense_layers`).
"""

import dataclasses
import math
from typing import Any

import numpy as np

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
)
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
        return architecture[:-len(CLASSIFIER_SUFFIX)] + "ForCausalLM"
    return architecture


def is_classifier(hf_config) -> bool:
    architectures = getattr(hf_config, "architectures", None) or []
    return bool(architectures) and architectures[0].endswith(CLASSIFIER_SUFFIX)


_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


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
    hidden_act: str = "silu"          # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    rotary_dim: int = 0               # leading dims of each head that rotate (partial rotary); 0 = all
    # longrope (Phi-3): per-frequency divisors [rotary_dim // 2], long ones once a sequence outgrows
    # rope_original_max_positions, and the factor cos and sin are multiplied by
    rope_short_factors: tuple[float, ...] = ()
    rope_long_factors: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0
    # Gemma 3: the rope base of the sliding-window (local) layers, 0 = every layer uses rope_theta
    local_rope_theta: float = 0.0
    # Gemma: norms multiply by (1 + w), the embedding by sqrt(hidden), and each block's output is
    # normed before the residual add (sandwich norms)
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    attn_scale: float = 0.0           # softmax scale; 0 = head_dim ** -0.5
    attn_softcap: float = 0.0         # attention logits -> cap * tanh(logits / cap); 0 = off
    final_softcap: float = 0.0        # the same on the output logits
    # mixture of experts: 0 experts = a dense MLP in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False      # renormalize the top-k probabilities to sum to 1
    shared_expert_size: int = 0       # Qwen2-MoE: a dense expert every token takes, sigmoid-gated; 0 = none
    dense_layers: tuple[int, ...] = ()   # layers of an MoE model with a dense MLP (intermediate_size) instead
    num_labels: int = 0               # a sequence classifier's classes (its `score` head's rows); 0 = none

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @property
    def uniform_layers(self) -> bool:
        """Every layer has the same weights' shapes (a scanned stack needs it)."""
        return not (self.is_moe and self.dense_layers)

    @property
    def local_rope_layers(self) -> tuple[bool, ...]:
        """Per layer: rotates with local_rope_theta (Gemma 3's sliding-window layers)."""
        return tuple(bool(self.local_rope_theta) and w > 0 for w in self.sliding_windows)

    def num_params(self) -> int:
        """Parameters that take part in a token's matmuls (for FLOP counts, the experts it is routed to
        only): 2 x this per token."""
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        dense = 3 * self.hidden_size * self.intermediate_size
        routed = 3 * self.hidden_size * (self.num_experts_per_tok * self.moe_intermediate_size
                                         + self.shared_expert_size) + self.hidden_size * self.num_experts
        mlp = sum(routed if self.is_moe_layer(i) else dense for i in range(self.num_layers))
        return self.num_layers * attention + mlp + self.hidden_size * self.vocab_size

    @property
    def rope_switch_len(self) -> int:
        """The sequence length past which LongRoPE takes its long factors (0: the rope does not switch).
        transformers recomputes a sequence's whole cache with the long factors when it grows past it;
        the scheduler does the same (Scheduler: a request outgrowing its rope is recomputed)."""
        return self.rope_original_max_positions if self.rope_type == "longrope" else 0

    def inv_freq(self, long: bool = False, local: bool = False) -> np.ndarray:
        """Rotary inverse frequencies [rotary_dim // 2] (before any length-dependent scaling); `long`:
        longrope's long factors, `local`: the local layers' base (local_rope_theta, unscaled)."""
        dim = self.rotary_dim or self.head_dim
        if local:
            return (1.0 / (self.local_rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))).astype(np.float32)
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.rope_type == "longrope":
            inv = inv / np.asarray(self.rope_long_factors if long else self.rope_short_factors, dtype=np.float64)
        if self.rope_freq_factors:   # as llama.cpp does: theta_i = pos * inv_freq_i / factor_i
            inv = inv / np.asarray(self.rope_freq_factors, dtype=np.float64)
        if self.rope_type == "linear":
            inv = inv / self.rope_factor
        elif self.rope_type == "llama3":
            orig = self.rope_original_max_positions
            low_wavelen = orig / self.rope_low_freq_factor
            high_wavelen = orig / self.rope_high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.rope_factor, inv)
            smooth = (orig / wavelen - self.rope_low_freq_factor) / (
                self.rope_high_freq_factor - self.rope_low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.rope_factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf_config, name, default)
    return default if value is None else value


def _rope_params(hf_config: Any, layer_type: str = "full_attention") -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and layer_type in params:   # per-layer-type form
        params = params[layer_type]
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    merged = {**legacy, **dict(params)}
    if "rope_theta" not in merged:
        merged["rope_theta"] = _get(hf_config, "rope_theta", 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "su":   # Phi-3's early name for longrope
        rope_type = "longrope"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
    merged["rope_type"] = rope_type
    return merged


def _local_rope_theta(hf_config: Any) -> float:
    """Gemma 3's sliding-window layers rotate with their own base (unscaled)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if not (isinstance(params, dict) and "sliding_attention" in params):
        local = getattr(hf_config, "rope_local_base_freq", None)
        return float(local) if local else 0.0
    local = _rope_params(hf_config, "sliding_attention")
    if local["rope_type"] != "default":
        raise ValueError(f"rope_parameters['sliding_attention'] rope_type {local['rope_type']!r} is not supported; "
                         "supported for the local layers: default")
    return float(local["rope_theta"])


def _sliding_windows(hf_config: Any, architecture: str, num_layers: int) -> tuple[int, ...]:
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return (0,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if architecture == "MistralForCausalLM" or not layer_types:
        return (int(window),) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in layer_types)


def _longrope(hf_config: Any, rope: dict, max_pos: int, dim: int) -> dict:
    """longrope's factors and attention factor as transformers computes them."""
    orig = int(rope.get("original_max_position_embeddings")
               or _get(hf_config, "original_max_position_embeddings", max_pos))
    short, long = rope.get("short_factor"), rope.get("long_factor")
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if factors is None or len(factors) != dim // 2:
            raise ValueError(f"rope_parameters {name} must list {dim // 2} factors (rotary dim {dim} / 2), "
                             f"got {None if factors is None else len(factors)}")
    factor = rope.get("factor") or max_pos / orig
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return dict(rope_short_factors=tuple(float(f) for f in short), rope_long_factors=tuple(float(f) for f in long),
                rope_attention_factor=float(attention_factor), rope_original_max_positions=orig)


def _moe_fields(hf_config: Any, architecture: str, num_layers: int) -> dict:
    if architecture not in _MOE:
        return {}
    if architecture == "MixtralForCausalLM":
        return dict(num_experts=int(hf_config.num_local_experts), num_experts_per_tok=int(hf_config.num_experts_per_tok),
                    moe_intermediate_size=int(hf_config.intermediate_size), norm_topk_prob=True)
    step = int(_get(hf_config, "decoder_sparse_step", 1))
    only = set(_get(hf_config, "mlp_only_layers", []) or [])
    dense = tuple(i for i in range(num_layers) if i in only or step < 1 or (i + 1) % step)
    return dict(num_experts=int(hf_config.num_experts), num_experts_per_tok=int(hf_config.num_experts_per_tok),
                moe_intermediate_size=int(hf_config.moe_intermediate_size),
                norm_topk_prob=bool(_get(hf_config, "norm_topk_prob", False)),
                shared_expert_size=int(_get(hf_config, "shared_expert_intermediate_size", 0) or 0)
                if architecture == "Qwen2MoeForCausalLM" else 0,
                dense_layers=dense)


def _gemma_fields(hf_config: Any, architecture: str) -> dict:
    if architecture not in _GEMMA:
        return {}
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported; jaxpaged runs "
                         "causal language models")
    return dict(norm_offset=1.0, embed_scale=float(hf_config.hidden_size) ** 0.5, sandwich_norms=True,
                attn_scale=float(_get(hf_config, "query_pre_attn_scalar", hf_config.head_dim)) ** -0.5,
                attn_softcap=float(_get(hf_config, "attn_logit_softcapping", 0.0)),
                final_softcap=float(_get(hf_config, "final_logit_softcapping", 0.0)),
                local_rope_theta=_local_rope_theta(hf_config) if architecture == "Gemma3ForCausalLM" else 0.0,
                qk_norm=architecture == "Gemma3ForCausalLM")


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """Read a transformers config; raises ValueError for an architecture or feature we don't run."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    classifier = is_classifier(hf_config)
    # no LM head in a bare model or a classifier: the input embedding stands in (its logits are not used)
    headless = classifier or architecture in BASE_MODEL_ARCHITECTURES
    given, architecture = architecture, causal_architecture(architecture)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {given!r} is not supported; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES + tuple(BASE_MODEL_ARCHITECTURES))}, and the "
                         f"{CLASSIFIER_SUFFIX} of each *ForCausalLM")
    num_labels = int(getattr(hf_config, "num_labels", 0) or 0) if classifier else 0
    if classifier and num_labels < 1:
        raise ValueError(f"{given} needs num_labels >= 1 in its config (id2label), got {num_labels}")
    act_field = "hidden_activation" if architecture in _GEMMA else "hidden_act"
    act = _get(hf_config, act_field, "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{act_field} {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    num_heads = hf_config.num_attention_heads
    head_dim = _get(hf_config, "head_dim", hf_config.hidden_size // num_heads)
    rope = _rope_params(hf_config)
    partial = float(rope.get("partial_rotary_factor", _get(hf_config, "partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of head_dim {head_dim}; "
                         "it must give an even number in (0, head_dim]")
    # Set by the GGUF loader; the factors compose with linear scaling as in llama.cpp, but
    # llama3 would scale twice and dynamic NTK recomputes the frequencies without them.
    freq_factors = tuple(float(f) for f in (getattr(hf_config, "rope_freq_factors", None) or ()))
    if freq_factors and rope["rope_type"] not in ("default", "linear"):
        raise ValueError(f"rope_freq_factors (a GGUF file's rope_freqs.weight) cannot be combined with "
                         f"rope_type {rope['rope_type']!r}; supported with them: default, linear")
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
    longrope = _longrope(hf_config, rope, max_pos, rotary_dim) if rope["rope_type"] == "longrope" else {}
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
        sliding_windows=_sliding_windows(hf_config, architecture, num_layers),
        rope_theta=float(rope["rope_theta"]),
        rope_type=rope["rope_type"],
        rope_factor=float(rope.get("factor", 1.0) or 1.0),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_positions=int(rope.get("original_max_position_embeddings", max_pos)),
        rope_freq_factors=freq_factors,
        bos_token_id=_get(hf_config, "bos_token_id", None),
        eos_token_ids=tuple(int(e) for e in eos_ids if e is not None),
        hidden_act=_ACTIVATIONS[act],
        rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
        num_labels=num_labels,
    )
    fields.update(longrope)
    fields.update(_moe_fields(hf_config, architecture, num_layers))
    fields.update(_gemma_fields(hf_config, architecture))
    return ModelConfig(**fields)
