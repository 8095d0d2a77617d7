"""The `cpu` attention backend: ragged paged attention through a native kernel on a CPU.

On a CPU the jnp reference gathers each chunk of pages into a copy and multiplies the copy (XLA:CPU
cannot fuse a gather into a dot), so attention costs the KV traffic twice over plus small batched
dots, and a mixed step pays a 16-token query tile for every decoding sequence. `cpu_attention.cc`
reads the pages where they lie instead, token by token (a prompt chunk's token is a decode over the
keys up to its position): an XLA FFI custom call, compiled on first use with the machine's C++
compiler (`$CXX`, else `c++`; ~3 s; `-march=native`, or without it where the compiler refuses it)
into `$JAXPAGED_CACHE/cpu_kernels` (default ~/.cache/jaxpaged, as the GGUF tokenizer cache: the root
is spelled out here because pallas_kernels imports nothing from jaxpaged), keyed by its source, the
flags, jax's version and this CPU. It takes f32 queries and pools with up to
16 query heads per kv head, head_dim <= 256 and block_size <= 64; other steps (bf16 or fp8 pools,
larger shapes) run the reference. Where no compiler builds it, `auto` stays on the reference (logged
once) and `attention_backend="cpu"` is a ValueError. Against the reference (`python -m
jaxpaged.bench.cpu_attention`): 2-5x faster on decode, mixed and short-prompt steps, 0.7x on one
1024-token prompt (its tokens each walk their own pages)."""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import ragged_paged_attention_reference, validate_inputs

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_attention.cc")
TARGET = "jaxpaged_ragged_paged_attention"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# Where a compiler refuses -march=native (some clang builds for arm64), the library is built without it.
PORTABLE_FLAGS = tuple(flag for flag in FLAGS if flag != "-march=native")
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64   # the kernel's scratch sizes (cpu_attention.cc)


def _cpu_id() -> str:
    """This CPU's model and instruction-set flags (the library is built for it: -march=native)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def library_path() -> str:
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), jax.__version__.encode(),
                                     platform.machine().encode(), _cpu_id().encode()])).hexdigest()[:16]
    root = os.environ.get("JAXPAGED_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged"))
    return os.path.join(root, "cpu_kernels", f"cpu_attention-{key}.so")


def build(path: str) -> None:
    """Compile the kernel into `path` (atomically: processes building at once each rename a whole file)."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found; set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        for flags in (FLAGS, PORTABLE_FLAGS):
            result = subprocess.run([compiler, *flags, f"-I{jax.ffi.include_dir()}", SOURCE, "-o", tmp],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                break
            logger.info("%s %s failed on %s:\n%s", compiler, " ".join(flags), SOURCE, result.stderr[-2000:])
        else:
            raise RuntimeError(f"{compiler} failed on {SOURCE}:\n{result.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def load() -> str | None:
    """Build (once per machine) and register the kernel; None, with the reason logged, where it cannot."""
    path = library_path()
    try:
        if not os.path.exists(path):
            logger.info("compiling the native CPU attention kernel into %s (once per machine)", path)
            build(path)
        library = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxpagedRaggedPagedAttention), platform="cpu")
    except (OSError, RuntimeError) as exc:
        logger.warning("the native CPU attention kernel is unavailable, attention runs the jnp reference: %s", exc)
        return None
    return path


def available() -> bool:
    return load() is not None


def supports(q: jax.Array, kv_pool: jax.Array) -> bool:
    """Whether the native kernel takes this step (else the reference does)."""
    _, _, _, kv_heads, block_size, head_dim = kv_pool.shape
    num_heads = q.shape[1]
    return (q.dtype == jnp.float32 and kv_pool.dtype == jnp.float32
            and num_heads % kv_heads == 0 and num_heads // kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK)


def ragged_paged_attention_cpu(q: jax.Array, kv_pool: jax.Array, layer: jax.Array, md: AttentionMetadata,
                               sliding_window: jax.Array | int = 0, soft_cap: float | jax.Array = 0.0, *,
                               sm_scale: float, **reference_options) -> jax.Array:
    """Same signature and results as `ragged_paged_attention_reference` (to f32 rounding)."""
    if not supports(q, kv_pool):
        return ragged_paged_attention_reference(q, kv_pool, layer, md, sliding_window, soft_cap, sm_scale=sm_scale,
                                                **reference_options)
    validate_inputs(q, kv_pool, md)
    if load() is None:
        raise RuntimeError("attention_backend='cpu' needs its native kernel, which did not build (see the log)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, kv_pool, jnp.asarray(layer, jnp.int32), md.kv_lens, md.block_tables, md.cu_q_lens,
                jnp.asarray(sliding_window, jnp.int32), jnp.asarray(soft_cap, jnp.float32),
                sm_scale=np.float32(sm_scale))
