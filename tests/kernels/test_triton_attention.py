"""The Triton kernel for ragged paged attention, checked on a machine without a GPU.

- `emulate_kernel` replays the kernel's launch in numpy, program by program (same operands, grid,
  key ranges, masks, dot input dtypes, output slots, split-K combine) against the reference;
- the kernel's own Triton code runs under Triton's CPU interpreter (in a subprocess: triton picks
  the interpreter when imported) in fp32 and fp16; the interpreter gets bf16 dots wrong (triton 3.8),
  so bf16 is covered by the emulation and the compile tests;
- the kernel is lowered through jax-triton for sm_90 and sm_80, to PTX that ptxas assembles.
Running the compiled kernel needs a GPU: `test_matches_reference_on_gpu` is skipped here.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels.layout import kv_pool_shape
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from jaxpaged.kernels.triton_attention import combine_splits, kernel_call_args, ragged_paged_attention_triton
from tests.kernels.cases import live_tokens, random_case
from tests.kernels.triton_emulation import replay

REPO = pathlib.Path(__file__).resolve().parents[2]


def emulate_kernel(q, kv_pool, layer, md, sliding_window=0, soft_cap=0.0, *, sm_scale, kv_chunk_blocks=8):
    """The kernel replayed in numpy on the same operands, program by program: same grid, key
    ranges, masks, dot input dtypes, output slots and split-K combine. Concrete inputs only; slow."""
    launch, operands, out_type, meta, tokens = kernel_call_args(q, kv_pool, layer, md, sliding_window, soft_cap,
                                                              sm_scale=sm_scale, kv_chunk_blocks=kv_chunk_blocks)
    acc, m_out, l_out = replay(operands, launch, sm_scale)
    return combine_splits(jnp.asarray(acc), jnp.asarray(m_out), jnp.asarray(l_out), launch, tokens, q.dtype)


def long_decode_case(rng, dtype, sliding_window):
    """Decodes over contexts of 300, 45 and 1 tokens (16-token pages), the rest of the pool garbage:
    with 16-key chunks and few programs the walk is split over many programs, some of them empty.
    Flagged decode-only as the engine sends it: the reference takes its flat-pages path."""
    block_size, kv_heads, head_dim, group = 16, 2, 64, 4
    kv_lens = np.array([300, 45, 1, 0], np.int32)
    blocks = -(-kv_lens // block_size)
    pool = rng.uniform(-1e3, 1e3, kv_pool_shape(2, 1 + blocks.sum() + 2, block_size, kv_heads, head_dim))
    tables = np.zeros((len(kv_lens), blocks.max() + 1), np.int32)
    ids = rng.permutation(np.arange(1, pool.shape[2]))
    for i, (kv_len, num) in enumerate(zip(kv_lens, blocks)):
        tables[i, :num], ids = ids[:num], ids[num:]
        for pos in range(kv_len):
            pool[1, :, tables[i, pos // block_size], :, pos % block_size] = rng.standard_normal((2, kv_heads, head_dim))
    q = rng.standard_normal((5, kv_heads * group, head_dim))
    q[3:] = np.nan                                          # padded tokens must not leak into live rows
    md = AttentionMetadata(kv_lens=jnp.asarray(kv_lens), block_tables=jnp.asarray(tables),
                           cu_q_lens=jnp.asarray([0, 1, 2, 3, 3], jnp.int32), q_tile=1, decode_only=True)
    kwargs = dict(sliding_window=jnp.int32(sliding_window), soft_cap=0.0, sm_scale=head_dim ** -0.5)
    return jnp.asarray(q, dtype), jnp.asarray(pool, dtype), jnp.int32(1), md, kwargs


def assert_close(got, want, md, dtype):
    live = live_tokens(md)
    got, want = (np.asarray(x[:live].astype(jnp.float32)) for x in (got, want))
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("group,block_size,head_dim,dtype,window,cap,kv_chunk_blocks,q_tile", [
    (1, 8, 64, jnp.float32, 0, 0.0, 2, 4),
    (2, 16, 128, jnp.bfloat16, 7, 0.0, 1, 2),
    (4, 32, 64, jnp.float32, 0, 2.0, 8, 8),
    (8, 16, 128, jnp.bfloat16, 20, 1.0, 4, 16),   # 128 rows: q_tile * group in one program
    (8, 8, 64, jnp.float32, 0, 0.0, 8, 8),        # fp32 caps rows at 32: two programs per tile
    (4, 16, 64, jnp.bfloat16, 0, 0.0, 8, 1),
])
def test_emulated_tiling_matches_reference(group, block_size, head_dim, dtype, window, cap, kv_chunk_blocks,
                                           q_tile):
    rng = np.random.default_rng(group * 1000 + block_size + head_dim)
    q, pool, layer, md, kwargs = random_case(rng, head_dim=head_dim, group=group, block_size=block_size, num_seqs=4,
                                             dtype=dtype, sliding_window=window, soft_cap=cap, q_tile=q_tile)
    got = emulate_kernel(q, pool, layer, md, **kwargs, kv_chunk_blocks=kv_chunk_blocks)
    assert_close(got, ragged_paged_attention_reference(q, pool, layer, md, **kwargs), md, dtype)


@pytest.mark.parametrize("window", [0, 100])
def test_long_decodes_split_over_programs_match_reference(window):
    q, pool, layer, md, kwargs = long_decode_case(np.random.default_rng(window), jnp.float32, window)
    launch = kernel_call_args(q, pool, layer, md, **kwargs, kv_chunk_blocks=1)[0]
    assert launch.num_splits > 1 and launch.chunk_tokens * launch.num_splits < 300  # more chunks than splits
    got = emulate_kernel(q, pool, layer, md, **kwargs, kv_chunk_blocks=1)
    assert_close(got, ragged_paged_attention_reference(q, pool, layer, md, **kwargs), md, jnp.float32)


INTERPRETER_SCRIPT = """
import json, numpy as np, torch, jax.numpy as jnp
from jaxpaged.kernels import triton_attention as ta
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from tests.kernels.cases import live_tokens, random_case
from tests.kernels.test_triton_attention import long_decode_case
rng, errors = np.random.default_rng(0), []
for chunk_blocks, case in [
        (2, lambda: random_case(rng, head_dim=64, group=4, block_size=8, num_seqs=4, dtype=jnp.float32,
                                sliding_window=9, soft_cap=2.0, q_tile=8)),
        (1, lambda: long_decode_case(rng, jnp.float16, 100))]:
    q, pool, layer, md, kwargs = case()
    launch, operands, out_type, meta, tokens = ta.kernel_call_args(q, pool, layer, md, **kwargs,
                                                                   kv_chunk_blocks=chunk_blocks)
    outs = [torch.zeros(o.shape, dtype=torch.float32) for o in out_type]
    ta._paged_attention_kernel[launch.grid](*(torch.from_numpy(np.array(x)) for x in operands), *outs, **meta)
    got = ta.combine_splits(*(jnp.asarray(o.numpy()) for o in outs), launch, tokens, jnp.float32)
    want = ragged_paged_attention_reference(q, pool, layer, md, **kwargs).astype(jnp.float32)
    errors.append(float(jnp.abs(got - want)[:live_tokens(md)].max()))
print(json.dumps(errors))
"""


def test_triton_code_under_interpreter_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    fp32_error, fp16_error = json.loads(run.stdout.strip().splitlines()[-1])
    assert fp32_error < 1e-5 and fp16_error < 1e-2, (fp32_error, fp16_error)


def lower_for_gpu(device_kind, dtype, head_dim, group, q_tile, block_size, pool_dtype=None):
    """jax-triton's CompilationResult (PTX, shared memory) of the kernel lowered for `device_kind`.

    Without the CUDA plugin jaxlib has no TritonKernel, so lowering stops right after the PTX is
    made: the result is read from jax-triton's `_compile_kernel` frame."""
    shape = jax.ShapeDtypeStruct
    kv_heads, num_seqs, max_blocks = 2, 8, 32
    q = shape((64, kv_heads * group, head_dim), dtype)
    pool = shape(kv_pool_shape(2, 300, block_size, kv_heads, head_dim), pool_dtype or dtype)
    md = AttentionMetadata(shape((num_seqs,), jnp.int32), shape((num_seqs, max_blocks), jnp.int32),
                           shape((num_seqs + 1,), jnp.int32), q_tile=q_tile)
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            ragged_paged_attention_triton.trace(
                q, pool, shape((), jnp.int32), md, shape((), jnp.int32), shape((), jnp.float32),
                sm_scale=head_dim ** -0.5).lower(lowering_platforms=("cuda",))
    except AttributeError as error:
        if "TritonKernel" not in str(error):
            raise
        for frame, _ in traceback.walk_tb(error.__traceback__):
            if frame.f_code.co_name == "_compile_kernel" and "compilation_result" in frame.f_locals:
                return frame.f_locals["compilation_result"]
        raise
    pytest.skip("jaxlib has the CUDA plugin here: the kernel lowered completely (see the GPU test)")


@pytest.mark.parametrize("device_kind,arch,shared_memory_limit", [
    ("NVIDIA H200", "sm_90a", 227 * 1024), ("NVIDIA A100", "sm_80", 163 * 1024)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim,group,q_tile,block_size", [(64, 8, 16, 16), (128, 4, 1, 32)])
def test_kernel_compiles_for_gpu(device_kind, arch, shared_memory_limit, dtype, head_dim, group, q_tile,
                                 block_size):
    pytest.importorskip("jax_triton")
    from triton.backends.nvidia.compiler import get_ptxas
    result = lower_for_gpu(device_kind, dtype, head_dim, group, q_tile, block_size)
    ptx = result.binary
    assert f".target {arch}" in ptx and ".entry _paged_attention_kernel" in ptx
    assert result.shared_mem_bytes <= shared_memory_limit
    if dtype == jnp.bfloat16:
        assert "mma" in ptx  # the dots run on tensor cores
    with tempfile.TemporaryDirectory() as folder:
        source = pathlib.Path(folder, "kernel.ptx")
        source.write_text(ptx)
        ptxas = subprocess.run([get_ptxas(int(arch[3:5])).path, "-v", f"--gpu-name={arch}", str(source),
                                "-o", str(source.with_suffix(".cubin"))], capture_output=True, text=True)
    assert ptxas.returncode == 0, ptxas.stderr
    assert " 0 bytes spill stores" in ptxas.stderr, ptxas.stderr  # plan_launch's tile sizes fit in registers


def tiny_inputs(**changes):
    args = dict(q=jnp.zeros((4, 4, 64), jnp.float32), kv_pool=jnp.zeros(kv_pool_shape(2, 4, 8, 2, 64), jnp.float32),
                layer=jnp.int32(0), md=AttentionMetadata(jnp.asarray([3, 1], jnp.int32), jnp.ones((2, 2), jnp.int32),
                                                         jnp.asarray([0, 3, 4], jnp.int32), q_tile=4),
                sliding_window=jnp.int32(0), soft_cap=0.0, sm_scale=0.125, kv_chunk_blocks=8)
    return {**args, **changes}


@pytest.mark.parametrize("changes,name", [
    (dict(q=jnp.zeros((4, 4, 64), jnp.int32)), "q dtype"),
    (dict(q=jnp.zeros((4, 3, 64), jnp.float32)), "num_heads"),
    (dict(kv_pool=jnp.zeros(kv_pool_shape(2, 4, 12, 2, 64), jnp.float32)), "kv_pool block_size"),
    (dict(layer=jnp.zeros((2,), jnp.int32)), "layer"),
    (dict(sliding_window=jnp.zeros((2,), jnp.int32)), "sliding_window"),
    (dict(kv_chunk_blocks=0), "kv_chunk_blocks"),
    (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(q=jnp.zeros((0, 4, 64), jnp.float32)), "q needs"),
])
def test_invalid_inputs_raise_value_error_naming_the_argument(changes, name):
    with pytest.raises(ValueError, match=name):
        ragged_paged_attention_triton(**tiny_inputs(**changes))


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="runs the compiled kernel: needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference_on_gpu(dtype):
    rng = np.random.default_rng(7)
    cases = [random_case(rng, head_dim=128, group=4, block_size=16, num_seqs=6, dtype=dtype, sliding_window=24,
                         soft_cap=30.0), long_decode_case(rng, dtype, 0)]
    for q, pool, layer, md, kwargs in cases:
        got = ragged_paged_attention_triton(q, pool, layer, md, **kwargs)
        assert_close(got, ragged_paged_attention_reference(q, pool, layer, md, **kwargs), md, dtype)
