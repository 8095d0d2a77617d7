"""attention_backend: the Mosaic GPU kernel (GPU interpret mode on CPU) and the Triton kernel's code path give
the reference's greedy outputs; `auto` picks only kernels that lower on the GPU at hand (device descriptions
faked); unavailable or unknown backends are clear errors, never silent fallbacks."""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.engine.test_llm_generate import tiny_llm
from tests.tiny_models import tiny_checkpoint


# gemma2: soft-capped attention, sliding and global layers, query_pre_attn_scalar (head_dim 32: the Mosaic
# kernel's fp32 rows are whole 128-byte swizzle rows). Mixtral is not run again here: its experts are in the MLP,
# and its attention is mistral's.
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_pallas_backend_matches_reference_greedy(arch):
    prompts = [{"prompt_token_ids": [5, 17, 42, 9, 100, 7, 8, 9, 10]}, {"prompt_token_ids": [3] * 19}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    path = tiny_checkpoint(arch, head_dim=32)

    def tokens_and_logprobs(backend):
        llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
                  compile_on_startup=False, attention_backend=backend)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [c.token_ids for c in outs], [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in outs]
    ours, ours_lp = tokens_and_logprobs("pallas")
    ref, ref_lp = tokens_and_logprobs("reference")
    assert ours == ref
    np.testing.assert_allclose(ours_lp, ref_lp, atol=1e-4)


class FakeGpu:
    """A CUDA device as jax describes one (platform, device_kind, compute_capability)."""
    platform = "gpu"

    def __init__(self, device_kind, compute_capability):
        self.device_kind, self.compute_capability = device_kind, compute_capability


H100, A100, L4, T4, B200 = (FakeGpu("NVIDIA H100 80GB HBM3", "9.0"), FakeGpu("NVIDIA A100-SXM4-40GB", "8.0"),
                            FakeGpu("NVIDIA L4", "8.9"), FakeGpu("Tesla T4", "7.5"), FakeGpu("NVIDIA B200", "10.0"))


@pytest.mark.parametrize("device,dtype,with_jax_triton,expected", [
    (H100, "bfloat16", True, ["pallas", "triton", "pallas_triton"]),
    (H100, "float32", True, ["triton", "pallas_triton"]),          # Mosaic's fp32 wgmma cannot take V as is
    (A100, "bfloat16", True, ["triton", "pallas_triton"]),
    (B200, "bfloat16", True, ["triton", "pallas_triton"]),         # no wgmma on Blackwell
    (L4, "bfloat16", False, ["pallas_triton"]),
    (T4, "float16", False, ["pallas_triton", "reference"]),
])
def test_auto_measures_only_kernels_that_lower_on_the_gpu(monkeypatch, device, dtype, with_jax_triton, expected):
    from jaxpaged.kernels import backends
    monkeypatch.setattr(backends, "_has_jax_triton", lambda: with_jax_triton)
    assert backends.gpu_candidates(device, dtype) == expected
    measured = []
    monkeypatch.setattr(backends, "measure_fastest", lambda kernels, *a: measured.append(list(kernels)) or expected[-1])
    assert backends.resolve_backend("auto", head_shape=(8, 2, 128), dtype=dtype, device=device) == expected[-1]
    assert measured == ([expected] if len(expected) > 1 else [])   # one candidate: nothing to measure


def test_auto_measures_the_reference_too_for_latent_attention_heads(monkeypatch):
    """DeepSeek's latent attention attends over 576-dim heads: the Mosaic kernel (up to 256) is not a
    candidate, and the reference joins the Triton kernels so that something runs."""
    from jaxpaged.kernels import backends
    monkeypatch.setattr(backends, "_has_jax_triton", lambda: True)
    assert backends.gpu_candidates(H100, "bfloat16", 576) == ["triton", "pallas_triton", "reference"]
    assert backends.gpu_candidates(H100, "bfloat16", 128) == ["pallas", "triton", "pallas_triton"]


def test_pallas_needs_hopper_on_a_gpu():
    from jaxpaged.kernels.backends import resolve_backend
    assert resolve_backend("pallas", device=H100) == "pallas"
    for device in (A100, B200):
        with pytest.raises(ValueError, match=f"attention_backend='pallas'.*Hopper.*{device.device_kind} has "):
            resolve_backend("pallas", device=device)
    with pytest.raises(ValueError, match="attention_backend='pallas_triton' needs a CUDA GPU"):
        resolve_backend("pallas_triton", platform="cpu")


def test_dtype_auto_is_float16_where_the_gpu_has_no_bfloat16():
    from jaxpaged.models.loader import resolve_dtype
    assert resolve_dtype("auto", "bfloat16", device=T4) == "float16"
    assert resolve_dtype("auto", "bfloat16", device=A100) == resolve_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "float32", device=T4) == "float32"
    with pytest.raises(ValueError, match="dtype='bfloat16' needs a GPU of compute capability 8.0"):
        resolve_dtype("bfloat16", "float32", device=T4)


def test_auto_and_the_cpu_alias_run_the_reference_on_a_cpu():
    from jaxpaged.kernels.backends import resolve_backend
    assert resolve_backend("auto", platform="cpu") == resolve_backend("cpu", platform="cpu") == "reference"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on a CPU, not gpu"):
        resolve_backend("cpu", platform="gpu")


def test_unavailable_and_unknown_backends_are_errors():
    with pytest.raises(ValueError, match="triton.*needs a CUDA GPU"):
        LLM(tiny_checkpoint("llama"), attention_backend="triton", compile_on_startup=False)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(tiny_checkpoint("llama"), attention_backend="flash", compile_on_startup=False)


def test_auto_measures_and_picks_the_fastest_kernel():
    import time

    from jaxpaged.kernels.backends import measure_fastest
    from jaxpaged.kernels.reference import ragged_paged_attention_reference as ref

    def broken(*args, **kwargs):
        raise RuntimeError("cannot compile here")

    import jax

    def slow(*args, **kwargs):   # sleeps inside every compiled call, not only while tracing
        out = ref(*args, **kwargs)
        return jax.pure_callback(lambda x: (time.sleep(0.02), x)[1], jax.ShapeDtypeStruct(out.shape, out.dtype), out)

    kernels = {"broken": broken, "slow": slow, "fast": ref}
    assert measure_fastest(kernels, 4, 2, 16, "float32", num_seqs=4, context=32, repeats=2) == "fast"
    assert measure_fastest({"broken": broken}, 4, 2, 16, "float32", num_seqs=4, context=32) == "broken"


@pytest.mark.parametrize("arch, output_keyword", [("gemma2", "out_type"), ("mixtral", "out_shape")])
def test_triton_backend_code_path_matches_reference_greedy(arch, output_keyword, monkeypatch):
    """The whole model through attention_backend="triton" on a CPU: everything but the kernel's own
    Triton code runs (launch plan, operands, split combine, soft-cap and window plumbing per layer),
    the kernel replayed program by program in numpy (tests/kernels/triton_emulation.py, which the
    kernel tests pin to the Triton code under Triton's interpreter). Through jax-triton 0.4's
    triton_call and 0.3's (the GPU image's triton 3.6 takes only 0.3), which name the outputs apart."""
    import sys

    from jaxpaged.kernels import backends
    from tests.kernels.triton_emulation import fake_jax_triton

    monkeypatch.setitem(sys.modules, "jax_triton", fake_jax_triton(output_keyword))
    resolve = backends.resolve_backend
    monkeypatch.setattr(backends, "resolve_backend", lambda name, *a, **k: "triton" if name == "triton" else
                        resolve(name, *a, **k))
    prompts = [{"prompt_token_ids": [5, 17, 42, 9, 100, 7, 8, 9, 10]}, {"prompt_token_ids": [3] * 19}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    triton = LLM(tiny_checkpoint(arch), dtype="float32", block_size=8, num_gpu_blocks_override=32,
                 max_model_len=64, compile_on_startup=False, attention_backend="triton")
    assert triton.llm_engine.loaded.model.attention_backend == "triton"

    def tokens_and_logprobs(llm):
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [c.token_ids for c in outs], [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in outs]
    ours, ours_lp = tokens_and_logprobs(triton)
    ref, ref_lp = tokens_and_logprobs(tiny_llm(arch))
    assert ours == ref
    np.testing.assert_allclose(ours_lp, ref_lp, atol=1e-4)
