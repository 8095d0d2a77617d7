"""Weight-only quantization (int8, fp8, int4) and GGUF blocks kept quantized.

The oracle for a quantized model is transformers on the same quantized weights: each HF linear
weight replaced by its de-quantized value (fp32), so the comparison isolates our packing, fusing,
sharding and matmuls from the quantization error itself, which is bounded separately.
"""

import functools
import os

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest

from jaxpaged.models import quantization as qz
from jaxpaged.models.loader import load_model
from tests.models.test_llama_family import BLOCK_SIZE, EVERY_ROW_STEP, assert_close, empty_pool, scattered_blocks
from tests.tiny_models import hf_logits, tiny_checkpoint

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@functools.cache
def dequantized_checkpoint(arch: str, mode: str) -> str:
    """The tiny checkpoint with every layer's linear weight replaced by de-quantize(quantize(w))."""
    from safetensors.numpy import load_file, save_file

    src = tiny_checkpoint(arch)
    dst = src + f"-dequantized-{mode}"
    if not os.path.isdir(dst):
        import shutil
        shutil.copytree(src, dst)
        tensors = load_file(os.path.join(src, "model.safetensors"))
        for name, w in tensors.items():
            if name.endswith(".weight") and name.startswith("model.layers.") and name.split(".")[-2] in LINEARS:
                tensors[name] = np.ascontiguousarray(qz.quantize(w.T, mode).dequantize().T)
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def forward_logits(path: str, tokens: list[int], quantized_matmul: str = "auto", **load_kwargs) -> np.ndarray:
    from flax import nnx

    from jaxpaged.runner.batch_builder import SeqChunk
    from tests.forward_batch import build_forward_batch

    loaded = load_model(path, dtype="float32", **load_kwargs)
    loaded.model.quantized_matmul = quantized_matmul
    graphdef, state = nnx.split(loaded.model)
    rng = np.random.default_rng(0)
    chunk = SeqChunk(tokens, 0, scattered_blocks(rng, 5), logits_positions=list(range(len(tokens))))
    batch = build_forward_batch([chunk], BLOCK_SIZE, 8, EVERY_ROW_STEP)
    forward = jax.jit(lambda state, pool, batch: nnx.merge(graphdef, state)(pool, batch))
    _, logits = forward(state, empty_pool(loaded.config), batch)
    return np.asarray(logits)[:len(tokens)], loaded


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", qz.MODES)
@pytest.mark.parametrize("scan_layers", [True, False])
def test_quantized_model_matches_transformers_on_the_same_quantized_weights(arch, mode, scan_layers):
    tokens = np.random.default_rng(1).integers(3, 320, 40).tolist()
    ours, loaded = forward_logits(tiny_checkpoint(arch), tokens, quantization=mode, scan_layers=scan_layers)
    assert loaded.quantization == mode
    layer = loaded.model.layers if scan_layers else loaded.model.layers[0]
    assert isinstance(layer["wqkv"].get_value(), qz.QuantizedWeight)
    assert_close(ours, hf_logits(dequantized_checkpoint(arch, mode), tokens))
    # and the weights really were quantized (the accuracy is measured on the real model, in test_smollm2)
    assert np.abs(ours - hf_logits(tiny_checkpoint(arch), tokens)).max() > 1e-3


def test_weight_bytes_shrink_with_each_mode():
    base = qz.weight_nbytes(load_model(tiny_checkpoint("qwen2"), dtype="float32", quantization=None).model.layers)
    ratios = {m: base / qz.weight_nbytes(load_model(tiny_checkpoint("qwen2"), dtype="float32",
                                                    quantization=m).model.layers) for m in qz.MODES}
    assert ratios["int8"] > 3.5 and ratios["fp8"] > 3.5 and ratios["int4"] > 5, ratios


@pytest.mark.parametrize("mode", qz.MODES)
def test_quantize_error_is_within_half_a_step(mode):
    w = np.random.default_rng(0).standard_normal((256, 96)).astype(np.float32)
    q = qz.quantize(w, mode)
    err = np.abs(q.dequantize() - w)
    step = np.repeat(q.scale, q.group_size, axis=0)
    if mode == "fp8":   # e4m3 keeps 3 mantissa bits: relative error at most 2^-4
        assert np.all(err <= np.abs(w) * 2 ** -4 + step * 2 ** -9)
    else:
        assert np.all(err <= step / 2 + 1e-7)
    packed = q.packed()
    assert packed.values.dtype == {"int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn, "int4": np.uint8}[mode]
    assert packed.in_features == 256 and packed.out_features == 96
    on_device = jax.tree.map(jax.numpy.asarray, packed)
    np.testing.assert_allclose(np.asarray(on_device.dequantize(np.float32)), q.dequantize(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_decode_to_what_gguf_dequantizes(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    w[3, :32] = 0.25   # a constant block: Q4_1's scale is 0 there
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    expected = gguf.quants.dequantize(raw, qtype).reshape(48, 128)
    host = qz.from_gguf_blocks(kind, raw, 48, 128)
    np.testing.assert_allclose(host.T.dequantize().T, expected, rtol=1e-6, atol=1e-7)
    device = host.T.packed()
    np.testing.assert_allclose(np.asarray(jax.tree.map(jax.numpy.asarray, device).dequantize(np.float32)).T,
                               expected, rtol=1e-6, atol=1e-7)


def test_bad_quantization_values_and_combinations_raise_naming_the_field(tmp_path):
    from jaxpaged.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="quantization must be one of .*'int8'"):
        EngineArgs(quantization="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'fp8_e5m2'"):
        EngineArgs(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="quantization='gguf' needs a checkpoint quantized that way"):
        load_model(tiny_checkpoint("llama"), dtype="float32", quantization="gguf")
    assert qz.resolve_quantization("auto", "gguf") == "gguf"
    assert qz.resolve_quantization(None, "gguf") is None
    with pytest.raises(ValueError, match="quantization='int8' cannot re-quantize a checkpoint already quantized"):
        qz.resolve_quantization("int8", "gguf")
    with pytest.raises(ValueError, match="int4.*divisible by 32"):
        qz.quantize(np.ones((48, 8), np.float32), "int4")


@pytest.mark.parametrize("arch,quantization", [("llama", "int4"), ("qwen2", "int8"), ("llama", "fp8")])
def test_the_matmul_kernel_gives_the_reference_logits(arch, quantization):
    """The whole model with every quantized matmul in the Pallas kernel (interpret mode on CPU; a
    48-token step is decode-shaped) against the de-quantizing jnp path."""
    tokens = np.random.default_rng(2).integers(3, 320, 40).tolist()
    ours, _ = forward_logits(tiny_checkpoint(arch), tokens, quantized_matmul="pallas", quantization=quantization)
    ref, _ = forward_logits(tiny_checkpoint(arch), tokens, quantized_matmul="reference", quantization=quantization)
    assert_close(ours, ref)


def test_the_builtin_gguf_blocks_run_through_the_kernel(monkeypatch):
    """The real model's Q4_1 layer weights and its Q8_0 tied LM head [576, 49152] (its first 1024
    columns: interpret mode runs the kernel's 768 programs of the whole head in ~40 s), through
    quantized_matmul="pallas" against the de-quantizing path; the Mosaic kernel takes those it tiles."""
    import jax.numpy as jnp

    from jaxpaged.kernels import mosaic_matmul
    from jaxpaged.models.builtin import builtin_model_path

    loaded = load_model(builtin_model_path(), dtype="float32", quantization="gguf")
    calls = []
    real = mosaic_matmul.quantized_matmul_mosaic
    monkeypatch.setattr(mosaic_matmul, "quantized_matmul_mosaic", lambda *a, **k: calls.append(1) or real(*a, **k))
    kernel = qz.matmul_kernel("pallas")
    head = loaded.model.embed.get_value()
    assert isinstance(head, qz.QuantizedWeight) and head.values.dtype == jnp.int8    # Q8_0 blocks kept
    weights = {name: jax.tree.map(lambda a: a[0], loaded.model.layers[name].get_value())   # layer 0 of the scan
               for name in ("wqkv", "wo", "w_gate_up", "w_down")}
    weights["lm_head"] = jax.tree.map(lambda a: a[:, :1024], head)
    for name, w in weights.items():
        assert w.bits == (8 if name == "lm_head" else 4) and w.group_size == 32, name
        x = jnp.asarray(np.random.default_rng(0).standard_normal((40, w.in_features)), jnp.float32)
        want = np.asarray(qz.linear(x, w))
        np.testing.assert_allclose(np.asarray(kernel(x, w)), want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                   err_msg=name)
    assert len(calls) == 2   # w_down (768 rows of bytes) and the head; the others' 288 rows take the Triton one


def test_auto_de_quantizes_gguf_blocks_at_load_unless_they_would_not_fit(monkeypatch):
    """On CPU the per-step path de-quantizes for XLA's matmul anyway, and on a GPU the quantized
    kernel ran slower than the bf16 matmul: "auto" de-quantizes once at load (the same logits as the
    blocks kept), but keeps the blocks where float weights would take over a quarter of the memory
    (the host's; a GPU's allocator limit)."""
    from jaxpaged.models import loader
    from jaxpaged.models.builtin import builtin_model_path

    tokens = list(range(100, 140))
    auto, loaded = forward_logits(builtin_model_path(), tokens)
    assert loaded.quantization is None and not isinstance(loaded.model.embed.get_value(), qz.QuantizedWeight)
    kept, _ = forward_logits(builtin_model_path(), tokens, quantization="gguf")
    assert_close(auto, kept)
    monkeypatch.setattr(loader.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 2**16)   # 256 MiB
    if jax.devices()[0].platform != "gpu":
        assert not loader._dequantize_gguf_at_load(135_000_000, "float32")
        assert loader._dequantize_gguf_at_load(10_000_000, "float32")

    class FakeGPU:   # its allocator's limit decides, not the host's memory
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 4 << 30}
    monkeypatch.setattr(loader.jax, "devices", lambda *args: [FakeGPU()])
    assert loader._dequantize_gguf_at_load(135_000_000, "bfloat16")       # 0.27 GB of 1 GiB
    assert not loader._dequantize_gguf_at_load(1_000_000_000, "bfloat16")  # 2 GB
