"""The `cpu` backend's native kernel (pallas_kernels/cpu_attention.cc) against attention written out
query by query (tests/kernels/test_reference.py's naive_attention) on the shared hostile cases:
scattered pages, garbage everywhere but the live KV, padded sequences and NaN padded tokens, decode
batches and prompt chunks mixed with decodes, windows, soft caps, head dims with and without a
compiled specialization. Steps it does not take (bf16 pools, shapes past its scratch) give exactly
the reference's output; where the kernel cannot be built, `auto` falls back to the reference and
`cpu` is an error naming the cause."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu_attention, cpu_native
from jaxpaged.kernels.backends import get_attention, resolve_backend
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from tests.kernels.cases import random_case
from tests.kernels.test_reference import assert_close, naive_attention


def _native_calls(fn, *args, **kwargs) -> int:
    """How many times the compiled `fn` calls the native kernel."""
    text = jax.jit(lambda *a: fn(*a, **kwargs)).lower(*args).as_text()
    return text.count(cpu_attention.TARGET)


# (head_dim, block_size, group, sliding_window, soft_cap, seed)
@pytest.mark.parametrize("decode_only", [True, False], ids=["decodes", "mixed"])
@pytest.mark.parametrize("head_dim,block_size,group,window,soft_cap,seed", [
    (64, 16, 3, 0, 0.0, 0),      # SmolLM2's heads: the specialized loop
    (128, 16, 4, 21, 0.0, 1),    # specialized, with a window that starts mid-page
    (64, 16, 1, 0, 30.0, 2),     # soft-capped
    (32, 8, 2, 11, 0.0, 3),      # the generic loop
    (80, 32, 5, 0, 5.0, 4),
    (64, 16, 16, 40, 0.0, 5),    # the largest group the scratch takes
])
def test_batches_match_naive_attention(head_dim, block_size, group, window, soft_cap, seed, decode_only):
    """Mixed: about half the sequences are prompt chunks of up to two pages plus one token."""
    rng = np.random.default_rng(seed)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=head_dim, group=group, block_size=block_size,
                                                num_seqs=9, dtype=jnp.float32, sliding_window=window,
                                                soft_cap=soft_cap, decode_only=decode_only, pad_seqs=3,
                                                max_blocks_per_seq=6)
    assert _native_calls(cpu_attention.ragged_paged_attention_cpu, q, kv_pool, layer, md, **kwargs) == 1
    got = jax.jit(lambda *a: cpu_attention.ragged_paged_attention_cpu(*a, **kwargs))(q, kv_pool, layer, md)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = naive_attention(q, kv_pool, layer, md, **kwargs)
    assert_close(got, want, md, jnp.float32)
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    n = int(md.cu_q_lens[-1])
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(ref[:n]), atol=2e-5)


def test_long_contexts_in_many_pages_and_a_traced_layer():
    """Forty pages a sequence (every page but the last prefetches the next), the layer chosen inside
    the compiled function as the scanned model does."""
    rng = np.random.default_rng(7)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=3, block_size=16, num_seqs=4,
                                                dtype=jnp.float32, decode_only=True, max_blocks_per_seq=40)
    got = jax.jit(lambda q, pool, md, i: cpu_attention.ragged_paged_attention_cpu(q, pool, i, md, **kwargs))(
        q, kv_pool, md, layer)
    assert_close(got, naive_attention(q, kv_pool, layer, md, **kwargs), md, jnp.float32)


@pytest.mark.parametrize("case", ["bfloat16", "group 32"])
def test_steps_the_kernel_does_not_take_are_the_references(case):
    rng = np.random.default_rng(11)
    q, kv_pool, layer, md, kwargs = random_case(
        rng, head_dim=32, group=32 if case == "group 32" else 2, block_size=8, num_seqs=5,
        dtype=jnp.bfloat16 if case == "bfloat16" else jnp.float32)
    assert _native_calls(cpu_attention.ragged_paged_attention_cpu, q, kv_pool, layer, md, **kwargs) == 0
    got = cpu_attention.ragged_paged_attention_cpu(q, kv_pool, layer, md, **kwargs)
    want = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    n = int(md.cu_q_lens[-1])
    np.testing.assert_array_equal(np.asarray(got[:n].astype(jnp.float32)), np.asarray(want[:n].astype(jnp.float32)))


def test_auto_picks_the_native_kernel_on_a_cpu():
    assert resolve_backend("auto", platform="cpu") == "cpu"
    assert get_attention("cpu", "cpu") is cpu_attention.ragged_paged_attention_cpu
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on a CPU, not gpu"):
        resolve_backend("cpu", platform="gpu")


def test_without_a_compiler_auto_is_the_reference_and_cpu_an_error(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("JAXPAGED_CACHE", str(tmp_path))   # nothing built here yet
    monkeypatch.setenv("CXX", "no-such-compiler")
    cpu_native.load.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert resolve_backend("auto", platform="cpu") == "reference"
        assert "no-such-compiler" in caplog.text and "runs the jnp reference" in caplog.text
        with pytest.raises(ValueError, match="needs its native kernel.*use 'reference'"):
            resolve_backend("cpu", platform="cpu")
        assert not list(tmp_path.rglob("*.so"))
    finally:
        cpu_native.load.cache_clear()   # the next caller loads the real library again
        monkeypatch.undo()
    assert cpu_native.available()


def test_a_compiler_that_refuses_march_native_still_builds_it(monkeypatch, tmp_path):
    """Some clang builds for arm64 refuse -march=native: the library is built without it, and runs."""
    import shutil
    import stat

    wrapper = tmp_path / "picky-c++"
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -march=native ] && { echo "no -march=native" >&2; '
                       f'exit 1; }}; done\nexec {shutil.which("c++")} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("JAXPAGED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(wrapper))
    path = cpu_native.library_path()
    cpu_native.build(path)
    import ctypes
    library = ctypes.cdll.LoadLibrary(path)
    assert library.JaxpagedRaggedPagedAttention and library.JaxpagedMatmul
    monkeypatch.setenv("CXX", "false")   # fails on every flag set: the error names the compiler
    with pytest.raises(RuntimeError, match="false failed on"):
        cpu_native.build(str(tmp_path / "other.so"))


def test_a_build_lands_whole_in_the_cache(monkeypatch, tmp_path):
    """The library is compiled under a temporary name and renamed: another process never loads half a file."""
    monkeypatch.setenv("JAXPAGED_CACHE", str(tmp_path))
    path = cpu_native.library_path()
    assert path.startswith(str(tmp_path / "cpu_kernels"))
    cpu_native.build(path)
    assert [p.name for p in (tmp_path / "cpu_kernels").iterdir()] == [path.rsplit("/", 1)[1]]
