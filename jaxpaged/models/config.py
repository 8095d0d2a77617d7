"""The model's own config: what the Flax model needs, read once from a Hugging Face config.

Llama, Mistral, Qwen2 and Qwen3 differ only in a few switches (q/k/v bias, q/k norm,
sliding windows, head_dim, rope scaling); they all become one `ModelConfig`.
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
)
_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def has_sliding_window(self) -> bool:
        return any(self.sliding_windows)

    def num_params(self) -> int:
        """Parameters that take part in per-token matmuls (for FLOP counts): 2 x this per token."""
        per_layer = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        per_layer += 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * per_layer + self.hidden_size * self.vocab_size

    def inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies [head_dim // 2] (before any length-dependent scaling)."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
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


def _rope_params(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "full_attention" in params:   # per-layer-type form
        params = params["full_attention"]
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    merged = {**legacy, **dict(params)}
    if "rope_theta" not in merged:
        merged["rope_theta"] = _get(hf_config, "rope_theta", 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
    merged["rope_type"] = rope_type
    return merged


def _sliding_windows(hf_config: Any, architecture: str, num_layers: int) -> tuple[int, ...]:
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return (0,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if architecture == "MistralForCausalLM" or not layer_types:
        return (int(window),) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in layer_types)


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """Read a transformers config; raises ValueError for an architecture or feature we don't run."""
    architectures = getattr(hf_config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    act = _get(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")
    num_heads = hf_config.num_attention_heads
    head_dim = _get(hf_config, "head_dim", hf_config.hidden_size // num_heads)
    rope = _rope_params(hf_config)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
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
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    return ModelConfig(
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
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(_get(hf_config, "mlp_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        sliding_windows=_sliding_windows(hf_config, architecture, num_layers),
        rope_theta=float(rope["rope_theta"]),
        rope_type=rope["rope_type"],
        rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_positions=int(rope.get("original_max_position_embeddings", max_pos)),
        rope_freq_factors=freq_factors,
        bos_token_id=_get(hf_config, "bos_token_id", None),
        eos_token_ids=tuple(int(e) for e in eos_ids if e is not None),
    )
