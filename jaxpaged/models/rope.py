"""Rotary position embeddings: how a Hugging Face config's rope is read, and the cos / sin it gives.

Rope types, as transformers computes them (modeling_rope_utils):

- default, linear (positions divided by `factor`), dynamic (NTK: the base stretched once a sequence
  outgrows max_position_embeddings), llama3 (low frequencies divided by `factor`, a smooth ramp
  between), all from `ModelConfig.rope_*`;
- longrope (Phi-3): per-frequency short factors, long ones once a sequence outgrows the original
  length, cos and sin times an attention factor;
- yarn (Qwen2.5 / Qwen3's long-context setting, OLMo 3, gpt-oss, DeepSeek): interpolated (divided by
  `factor`) below a band of dimensions, extrapolated (unchanged) above it, a linear ramp between
  (`beta_fast` / `beta_slow` rotations over the original length), cos and sin times an attention
  factor (`mscale`). Static: the same frequencies at every length.

`inv_freq` gives the frequencies `ModelConfig.inv_freq` returns; `rotary_cos_sin` and `apply_rotary` run
in the model's jitted step. Qwen2-VL's and Qwen2.5-VL's multimodal rope (M-RoPE, `mrope_cos_sin`): three
position streams (time, height, width), each turning its own section of the frequencies; on text the three
are the same position, which is the plain rope.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")


def _get(hf_config: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf_config, name, default)
    return default if value is None else value


def rope_params(hf_config: Any, layer_type: str = "full_attention") -> dict:
    """The rope parameters of `layer_type`'s layers (a per-layer-type config's entry, or the one
    dict), legacy `rope_scaling` merged in; ValueError for a rope type we do not compute."""
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
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    merged["rope_type"] = rope_type
    return merged


def local_rope_theta(hf_config: Any) -> float:
    """The rope base of the sliding-window layers where a config gives them their own (Gemma 3's
    rope_local_base_freq, a `sliding_attention` entry in rope_parameters: Gemma 3, OLMo 3), unscaled;
    0.0 where every layer rotates alike."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if not (isinstance(params, dict) and "sliding_attention" in params):
        local = getattr(hf_config, "rope_local_base_freq", None)
        return float(local) if local else 0.0
    local = rope_params(hf_config, "sliding_attention")
    if local["rope_type"] != "default":
        raise ValueError(f"rope_parameters['sliding_attention'] rope_type {local['rope_type']!r} is not supported; "
                         "supported for the local layers: default")
    return float(local["rope_theta"])


def longrope_fields(hf_config: Any, rope: dict, max_pos: int, dim: int) -> dict:
    """longrope's ModelConfig fields: its factors and attention factor as transformers computes them."""
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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_mscale(rope: dict) -> float:
    """What latent attention's softmax scale is multiplied by (DeepSeek): yarn's mscale for
    mscale_all_dim, squared (it scales the dims of q . k that do not rotate too), 1 without one."""
    if rope.get("rope_type", "default") == "default" or not rope.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2


def yarn_fields(hf_config: Any, rope: dict, max_pos: int) -> dict:
    """yarn's ModelConfig fields: its factor (max_position_embeddings / the original length where
    the config gives none, as DeepSeek's), ramp and attention factor as transformers computes them."""
    orig = int(rope.get("original_max_position_embeddings")
               or _get(hf_config, "original_max_position_embeddings", max_pos))
    factor = rope.get("factor") or max_pos / orig
    if factor < 1.0:
        raise ValueError(f"rope_parameters factor must be >= 1 for yarn, got {factor}")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    return dict(rope_factor=float(factor), rope_original_max_positions=orig,
                rope_attention_factor=float(attention_factor),
                rope_yarn_betas=(float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)),
                rope_yarn_truncate=bool(rope.get("truncate", True)))


def _yarn_inv_freq(cfg, dim: int) -> np.ndarray:
    base, orig = cfg.rope_theta, cfg.rope_original_max_positions

    def correction_dim(rotations: float) -> float:   # the dimension that turns `rotations` times over orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    beta_fast, beta_slow = cfg.rope_yarn_betas
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    keep = 1.0 - ramp   # 1: extrapolate (the fast dimensions), 0: interpolate
    return extrapolated / cfg.rope_factor * (1.0 - keep) + extrapolated * keep


def inv_freq(cfg, long: bool = False, local: bool = False) -> np.ndarray:
    """Rotary inverse frequencies f32[rotary_dim // 2] of a ModelConfig (before any length-dependent
    scaling); `long`: longrope's long factors, `local`: the local layers' base (local_rope_theta,
    unscaled)."""
    dim = cfg.rotary_dim or cfg.head_dim
    if local:
        return (1.0 / (cfg.local_rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))).astype(np.float32)
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg, dim).astype(np.float32)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if cfg.rope_type == "longrope":
        inv = inv / np.asarray(cfg.rope_long_factors if long else cfg.rope_short_factors, dtype=np.float64)
    if cfg.rope_freq_factors:   # as llama.cpp does: theta_i = pos * inv_freq_i / factor_i
        inv = inv / np.asarray(cfg.rope_freq_factors, dtype=np.float64)
    if cfg.rope_type == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        orig = cfg.rope_original_max_positions
        low_wavelen = orig / cfg.rope_low_freq_factor
        high_wavelen = orig / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (orig / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rotary_cos_sin(cfg, positions: jax.Array, seq_lens: jax.Array | None,
                   local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin [num_tokens, rotary_dim // 2] for each token's absolute position.

    Dynamic NTK scaling stretches the base once a sequence outgrows the trained length, and
    longrope takes its long factors then, as transformers does; `seq_lens` (i32[num_tokens]) is
    the sequence length each token's rope is chosen for (ForwardBatch.rope_lens). `local`: the
    local layers' rope (their own base).
    """
    if local:
        freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(cfg.inv_freq(local=True))[None, :]
        return jnp.cos(freqs), jnp.sin(freqs)
    inv = jnp.asarray(cfg.inv_freq())[None, :]
    if cfg.rope_type == "longrope":
        long = (seq_lens > cfg.rope_original_max_positions)[:, None]
        inv = jnp.where(long, jnp.asarray(cfg.inv_freq(long=True))[None, :], inv)
    elif cfg.rope_type == "dynamic":
        dim = cfg.rotary_dim or cfg.head_dim
        max_pos = cfg.max_position_embeddings
        seq_len = jnp.maximum(seq_lens, max_pos).astype(jnp.float32)[:, None]
        base = cfg.rope_theta * (cfg.rope_factor * seq_len / max_pos - (cfg.rope_factor - 1)) ** (dim / (dim - 2))
        exponents = jnp.arange(0, dim, 2, dtype=jnp.float32)[None, :] / dim
        inv = 1.0 / (base ** exponents)
    freqs = positions.astype(jnp.float32)[:, None] * inv
    if cfg.rope_type in ("longrope", "yarn"):
        return jnp.cos(freqs) * cfg.rope_attention_factor, jnp.sin(freqs) * cfg.rope_attention_factor
    return jnp.cos(freqs), jnp.sin(freqs)


def mrope_cos_sin(cfg, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [num_tokens, head_dim // 2] of M-RoPE: positions i32[num_tokens, 3] (time, height, width);
    frequency i takes the stream of the `cfg.mrope_section` it falls in (transformers' mrope_section, the
    sections in order, not interleaved)."""
    stream = np.repeat(np.arange(len(cfg.mrope_section)) % 3, cfg.mrope_section)
    picked = positions[:, stream].astype(jnp.float32)                       # [T, head_dim // 2]
    freqs = picked * jnp.asarray(cfg.inv_freq())[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, head_dim] with transformers' rotate-half layout (not interleaved) over its first
    2 x cos.shape[-1] dims (all of them, or a partial rotary's); the rest pass through."""
    x32 = x.astype(jnp.float32)
    half = cos.shape[-1]
    x1, x2, rest = x32[..., :half], x32[..., half:2 * half], x32[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1).astype(x.dtype)
