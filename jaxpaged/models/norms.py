"""The models' norms, in f32: RMSNorm, and LayerNorm (the mean-centred input's RMSNorm, with a bias or not), each
times (offset + weight) (Gemma's and Nemotron's norms hold w with offset 1)."""

import jax
import jax.numpy as jnp

from jaxpaged.models.config import ModelConfig


def layer_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0, bias=None) -> jax.Array:
    """LayerNorm in f32: `rms_norm` of the mean-centred input, plus `bias` (None: Cohere's, without one)."""
    x32 = x.astype(jnp.float32)
    out = rms_norm(x32 - jnp.mean(x32, axis=-1, keepdims=True), weight, eps, offset)
    return (out if bias is None else out + bias.astype(jnp.float32)).astype(x.dtype)


def norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array, bias=None) -> jax.Array:
    """The model's norm: RMSNorm, or LayerNorm (`cfg.layer_norm`, with `bias` where `cfg.norm_bias`), eps and
    offset its own."""
    if cfg.layer_norm:
        return layer_norm(x, weight, cfg.rms_norm_eps, cfg.norm_offset, bias)
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_offset)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in f32, times (offset + weight): Gemma's norms hold w with offset 1."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (weight.astype(jnp.float32) + offset)).astype(x.dtype)
