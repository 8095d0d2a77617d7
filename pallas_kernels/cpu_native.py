"""The native CPU kernels' library: built on first use, cached, registered with XLA's FFI.

`cpu_attention.cc` (ragged paged attention, cpu_attention.py) and `cpu_matmul.cc` (a dense f32
matmul that reads a stacked layer weight in place, cpu_matmul.py) share `cpu_parallel.h` and are
compiled together with the machine's C++ compiler (`$CXX`, else `c++`; a few seconds; `-march=native`,
or without it where the compiler refuses it) into `$JAXPAGED_CACHE/cpu_kernels` (default
~/.cache/jaxpaged, as the GGUF tokenizer cache: the root is spelled out here because pallas_kernels
imports nothing from jaxpaged), keyed by their sources, the flags, jax's version and this CPU.
Where no compiler builds it, `available()` is False with the reason logged once: `auto` then stays
on the jnp reference and XLA's matmuls."""

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

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(HERE, name) for name in ("cpu_attention.cc", "cpu_matmul.cc"))
HEADERS = (os.path.join(HERE, "cpu_parallel.h"),)
# FFI target name -> the handler's symbol in the library
TARGETS = {"jaxpaged_ragged_paged_attention": "JaxpagedRaggedPagedAttention", "jaxpaged_matmul": "JaxpagedMatmul"}
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# Where a compiler refuses -march=native (some clang builds for arm64), the library is built without it.
PORTABLE_FLAGS = tuple(flag for flag in FLAGS if flag != "-march=native")


def _cpu_id() -> str:
    """This CPU's model and instruction-set flags (the library is built for it: -march=native)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def library_path() -> str:
    parts = []
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            parts.append(f.read())
    parts += [" ".join(FLAGS).encode(), jax.__version__.encode(), platform.machine().encode(), _cpu_id().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    root = os.environ.get("JAXPAGED_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged"))
    return os.path.join(root, "cpu_kernels", f"cpu_kernels-{key}.so")


def build(path: str) -> None:
    """Compile the kernels into `path` (atomically: processes building at once each rename a whole file)."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} not found; set CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        for flags in (FLAGS, PORTABLE_FLAGS):
            result = subprocess.run([compiler, *flags, f"-I{jax.ffi.include_dir()}", *SOURCES, "-o", tmp],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                break
            logger.info("%s %s failed:\n%s", compiler, " ".join(flags), result.stderr[-2000:])
        else:
            raise RuntimeError(f"{compiler} failed on {', '.join(SOURCES)}:\n{result.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def load() -> str | None:
    """Build (once per machine) and register the kernels; None, with the reason logged, where it cannot."""
    path = library_path()
    try:
        if not os.path.exists(path):
            logger.info("compiling the native CPU kernels into %s (once per machine)", path)
            build(path)
        library = ctypes.cdll.LoadLibrary(path)
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, RuntimeError) as exc:
        logger.warning("the native CPU kernels are unavailable, attention runs the jnp reference "
                       "and matmuls XLA's: %s", exc)
        return None
    return path


def available() -> bool:
    return load() is not None
