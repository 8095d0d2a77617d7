"""FP8 Hugging Face checkpoints (transformers' block-wise "fp8", compressed-tensors float8 per
channel) load as they are: the device holds the checkpoint's own fp8 bytes, and the logits are
transformers' on the de-quantized weights."""

import functools
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from jaxpaged.models import quantization as qz
from jaxpaged.models.loader import load_model
from tests.models.test_llama_family import assert_close
from tests.models.test_quantization import LINEARS, forward_logits
from tests.tiny_models import hf_logits, scratch_folder, tiny_checkpoint

FP8_MAX = 448.0
CONFIGS = {
    "fp8-blocks": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                   "modules_to_not_convert": ["lm_head"]},
    "compressed-tensors-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                       "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
                                   "ignore": ["lm_head"]},
}


def quantize_fp8(w: np.ndarray, kind: str, block: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fp8 values [out, in], the scale tensor as the format stores it, the de-quantized weight)."""
    out_f, in_f = w.shape
    if kind == "fp8-blocks":
        blocks = w.reshape(out_f // block, block, in_f // block, block)
        scale = np.abs(blocks).max(axis=(1, 3)) / FP8_MAX                   # [out / block, in / block]
        full = np.repeat(np.repeat(scale, block, 0), block, 1)
    else:
        scale = np.abs(w).max(axis=1, keepdims=True) / FP8_MAX               # [out, 1]
        full = np.repeat(scale, in_f, 1)
    values = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return values, scale.astype(np.float32), values.astype(np.float32) * full


# DeepSeek's latent attention's linears (its released V3 / R1 weights are block-wise fp8)
MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@functools.cache
def checkpoints(kind: str, arch: str = "llama", linears: tuple[str, ...] | None = None, block: int | None = None,
                **overrides) -> tuple[str, str]:
    """(the FP8 checkpoint, the same weights de-quantized as an fp32 one) from a tiny model, its `linears`
    quantized in blocks of `block` (deepseek_v3: 8 by default, which its small projections divide into)."""
    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoint(arch, **overrides)
    block = block or (8 if arch == "deepseek_v3" else 32)
    linears = linears or (MLA_LINEARS if arch == "deepseek_v3" else LINEARS)
    variant = f"-{kind}" + ("" if arch == "llama" else f"-{block}-{'-'.join(linears)}")
    fp8, dequantized = src + variant, src + variant + "-dequantized"
    if not os.path.isdir(fp8):
        tensors = load_file(os.path.join(src, "model.safetensors"))
        quantized, plain = {}, {}
        for name, w in tensors.items():
            if name.endswith(".weight") and name.split(".")[-2] in linears:
                values, scale, back = quantize_fp8(w, kind, block)
                quantized[name] = values
                suffix = "weight_scale_inv" if kind == "fp8-blocks" else "weight_scale"
                quantized[name[:-len("weight")] + suffix] = scale
                plain[name] = back
            else:
                quantized[name] = plain[name] = w
        import torch
        from safetensors.torch import save_file as save_torch   # numpy's writer has no float8 (safetensors #682)

        def as_torch(a):
            if a.dtype == ml_dtypes.float8_e4m3fn:
                return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            return torch.from_numpy(np.ascontiguousarray(a))
        shutil.copytree(src, fp8)
        save_torch({k: as_torch(v) for k, v in quantized.items()}, os.path.join(fp8, "model.safetensors"),
                   metadata={"format": "pt"})
        shutil.copytree(src, dequantized)
        save_file(plain, os.path.join(dequantized, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(fp8, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = dict(CONFIGS[kind], **({"weight_block_size": [block, block]}
                                                                 if kind == "fp8-blocks" else {}))
        with open(os.path.join(fp8, "config.json"), "w") as f:
            json.dump(config, f)
    return fp8, dequantized


@pytest.mark.parametrize("kind", CONFIGS)
def test_fp8_checkpoints_load_without_requantizing(kind):
    fp8, dequantized = checkpoints(kind)
    tokens = np.random.default_rng(3).integers(3, 320, 40).tolist()
    ours, loaded = forward_logits(fp8, tokens, scan_layers=False)
    assert loaded.quantization == "fp8"
    wqkv = loaded.model.layers[0]["wqkv"].get_value()
    assert isinstance(wqkv, qz.QuantizedWeight) and wqkv.values.dtype == ml_dtypes.float8_e4m3fn
    assert wqkv.group_size == (32 if kind == "fp8-blocks" else 64)
    from jaxpaged.models.safetensors_io import Checkpoint   # the checkpoint's own bytes, in our layout
    stored = Checkpoint(fp8).get("model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_array_equal(np.asarray(wqkv.values)[:, :64].view(np.uint8), stored.view(np.uint8).T)
    assert_close(ours, hf_logits(dequantized, tokens))
    # quantization=None de-quantizes: the same logits from float weights
    plain, loaded = forward_logits(fp8, tokens, quantization=None)
    assert loaded.quantization is None and not isinstance(loaded.model.layers["wqkv"].get_value(), qz.QuantizedWeight)
    assert_close(plain, hf_logits(dequantized, tokens))


def test_deepseek_v3_fp8_checkpoint_loads_its_latent_attention():
    """DeepSeek-V3's layout of a block-wise fp8 checkpoint: the latent's projection and the query's stay fp8 on
    the device where the loader need not reorder them, kv_b_proj is split into its per-head halves and the
    rope's rows reordered in float; the logits are transformers' on the de-quantized weights."""
    fp8, dequantized = checkpoints("fp8-blocks", "deepseek_v3")
    tokens = np.random.default_rng(4).integers(3, 320, 40).tolist()
    ours, loaded = forward_logits(fp8, tokens)
    assert loaded.quantization == "fp8"
    layer = loaded.model.layers[1]
    assert isinstance(layer["wq_a"].get_value(), qz.QuantizedWeight) and isinstance(layer["wo"].get_value(),
                                                                                      qz.QuantizedWeight)
    assert_close(ours, hf_logits(dequantized, tokens))


def test_bad_combinations_with_prequantized_checkpoints_raise():
    fp8, _ = checkpoints("fp8-blocks")
    with pytest.raises(ValueError, match="quantization='int4' cannot re-quantize a checkpoint already quantized "
                                         "as 'fp8'"):
        load_model(fp8, quantization="int4")
    gptq = tiny_checkpoint("llama") + "-gptq"
    if not os.path.isdir(gptq):
        shutil.copytree(tiny_checkpoint("llama"), gptq)
        with open(os.path.join(gptq, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
        with open(os.path.join(gptq, "config.json"), "w") as f:
            json.dump(config, f)
    with pytest.raises(ValueError, match="quantization='fp8' cannot re-quantize a checkpoint already quantized "
                                         "as 'gptq'"):
        load_model(gptq, quantization="fp8")
    with pytest.raises(ValueError, match="quantized as 'gptq', which jaxpaged cannot load"):
        load_model(gptq)


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., in] (in a multiple of 32) -> (blocks u8[..., in / 32, 16], scales u8[..., in / 32]): each 32
    values' e8m0 scale the power of two that brings their largest to at most 6, each value the nearest e2m1."""
    lut = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(groups).max(axis=-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(np.float32(1.0), exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - lut).argmin(axis=-1) | np.where(scaled < 0, 8, 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    # contiguous: safetensors' numpy writer saves an array's buffer whatever its strides
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exponent + 127).astype(np.uint8))


@functools.cache
def gpt_oss_mxfp4() -> tuple[str, str]:
    """(the tiny gpt-oss with its experts in MXFP4 as OpenAI released gpt-oss, the same weights de-quantized
    by transformers' own MXFP4 decoder, saved as an fp32 checkpoint)."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = tiny_checkpoint("gpt_oss")
    mx, plain = src + "-mxfp4", src + "-mxfp4-dequantized"
    if not os.path.isdir(mx):
        tensors = load_file(os.path.join(src, "model.safetensors"))
        quantized, dequantized = {}, dict(tensors)
        for name, w in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):   # [experts, in, out]
                blocks, scales = encode_mxfp4(np.swapaxes(w, 1, 2))           # stored [experts, out, in]
                quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
                back = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                  dtype=torch.float32)        # transformers': [experts, in, out]
                dequantized[name] = back.numpy()
                assert 0 < np.abs(back.numpy() - w).max() < 0.5 * np.abs(w).max()   # rounded, not garbage
            else:
                quantized[name] = w
        shutil.copytree(src, mx)
        save_file(quantized, os.path.join(mx, "model.safetensors"), metadata={"format": "pt"})
        shutil.copytree(src, plain)
        save_file(dequantized, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(mx, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
        with open(os.path.join(mx, "config.json"), "w") as f:
            json.dump(config, f)
    return mx, plain


def test_gpt_oss_mxfp4_experts_load_de_quantized():
    """gpt-oss as released: MXFP4 experts, read into floats at load (no MXFP4 kernel yet); the logits are
    transformers' on the weights its own decoder de-quantizes."""
    mx, plain = gpt_oss_mxfp4()
    tokens = np.random.default_rng(4).integers(3, 320, 40).tolist()
    ours, loaded = forward_logits(mx, tokens)
    assert loaded.quantization is None
    assert_close(ours, hf_logits(plain, tokens))
    with pytest.raises(ValueError, match="quantization='int8' cannot re-quantize a checkpoint already quantized "
                                         "as 'mxfp4'"):
        load_model(mx, quantization="int8")
    from jaxpaged.models.loader import convert_checkpoint   # `jaxpaged convert`: the expert biases' stacks too
    converted = scratch_folder("gpt-oss-orbax-")
    convert_checkpoint(mx, converted, "float32", None)
    assert_close(forward_logits(converted, tokens)[0], hf_logits(plain, tokens))
