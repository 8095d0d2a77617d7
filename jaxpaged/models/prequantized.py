"""Hugging Face checkpoints that come quantized: FP8 weights loaded as they are, not re-quantized.

Two layouts of float8_e4m3fn linear weights ([out, in], as PyTorch stores them) are read:

- transformers' "fp8" (`quantization_config.quant_method: "fp8"`, e.g. DeepSeek-V3, Qwen3-FP8):
  `<name>.weight_scale_inv` f32[ceil(out / bo), ceil(in / bi)], one scale per `weight_block_size`
  [bo, bi] block (w = q * scale_inv, despite the name);
- compressed-tensors float8 (`quant_method: "compressed-tensors"`, weights of `type: float`, 8 bits):
  `<name>.weight_scale` f32[out, 1] (channel), [1] or [] (tensor), or [out / bo, in / bi] (block).
  Activation scales (`input_scale`) are ignored: activations stay in the model dtype.

Either becomes a `HostQuantized` whose scales are per (group of input rows, output row): a block's
scale repeated over its output rows, its column width the group. Tensors left unquantized
(`modules_to_not_convert`, `ignore`) are stored in 16 bits and pass through as they are.

gpt-oss's released experts are MXFP4 (`quant_method: "mxfp4"`): `<name>_blocks` u8[experts, out, in / 32,
16] (two e2m1 values a byte, the low nibble first) and `<name>_scales` u8[experts, out, in / 32] (e8m0:
2^(s - 127) per 32 values). No kernel runs them yet: `mxfp4_dequantize` turns them into floats at load.
"""

import math

import ml_dtypes
import numpy as np

from jaxpaged.models.quantization import HostQuantized

_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def checkpoint_quantization(hf_config) -> str | None:
    """The checkpoint's own quantization method: None, "fp8", or another name (for messages)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "unknown")).lower()
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
            return "fp8"
        kinds = sorted({f"{w.get('type')}{w.get('num_bits')}" for w in weights})
        return f"compressed-tensors ({', '.join(kinds) or 'unknown'})"
    return method


_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)   # e2m1 by its 4 bits


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks u8[..., groups, 16] and scales u8[..., groups] -> f32[..., groups x 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: "
                         "expected blocks [..., groups, 16] and scales [..., groups]")
    values = np.empty(scales.shape + (32,), np.float32)
    values[..., 0::2] = _FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = _FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(scales.shape[:-1] + (-1,))


def fp8_reader(get, has, dequantize: bool):
    """A `get(name)` that returns an FP8 weight with its scales as HostQuantized ([out, in]), or
    de-quantized to f32 when `dequantize` (quantization=None); every other tensor as stored."""
    def read(name: str):
        tensor = get(name)
        if tensor.dtype != _FP8 or not name.endswith(".weight"):
            return tensor
        stem = name[:-len("weight")]
        scale_name = next((stem + s for s in ("weight_scale_inv", "weight_scale") if has(stem + s)), None)
        if scale_name is None:
            raise ValueError(f"FP8 tensor {name!r} has no {stem}weight_scale_inv or {stem}weight_scale")
        quantized = _with_scales(name, tensor, np.asarray(get(scale_name), np.float32))
        return quantized.T.dequantize().T if dequantize else quantized
    return read


def _with_scales(name: str, values: np.ndarray, scale: np.ndarray) -> HostQuantized:
    out_features, in_features = values.shape
    if scale.size == 1:                                        # per tensor
        scale = np.full((out_features, 1), float(scale.reshape(())), np.float32)
    if scale.ndim != 2:
        raise ValueError(f"scale of {name!r} has shape {list(scale.shape)}; expected [out, 1], [1] or "
                         "[out / block, in / block]")
    rows, cols = scale.shape
    block_out, group = math.ceil(out_features / rows), math.ceil(in_features / cols)
    if in_features % group:
        raise ValueError(f"{name!r}: {in_features} input columns in blocks of {group} leave a partial block, "
                         "which jaxpaged's quantized layout cannot hold")
    scale = np.repeat(scale, block_out, axis=0)[:out_features]   # each output row its block's scale
    return HostQuantized(values, np.ascontiguousarray(scale), None, bits=8, group_size=group, kind="fp8")
