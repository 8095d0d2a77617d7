"""Parts about the machine: environment, jax-triton probe, device copy bandwidth, KV swap to pinned host."""

import functools
import importlib
import os
import platform
import shutil
import statistics
import subprocess
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gpu_check.common import Context, Row, guarded, time_call
from jaxpaged.runner.block_ops import HostSwapSpace
from jaxpaged.kernels import kv_pool_shape

# Modules the engine, the kernels and the server need; on the GPU image some come as carried wheels.
IMPORTS = ("jaxpaged.kernels.pallas_attention", "jaxpaged.kernels.triton_attention", "jax_triton", "starlette",
           "uvicorn", "gguf", "jaxpaged.server.app")
_VERSIONS = ("jax", "jaxlib", "flax", "numpy", "transformers", "triton", "jax_triton", "torch")


def jax_triton_keyword() -> str:
    """How this jax-triton takes the kernel's output shapes, for the table: jax-triton 0.4 calls the
    keyword `out_type`, 0.3 (the one the GPU image's triton 3.6 accepts) `out_shape`; the kernel
    (jaxpaged.kernels.triton_attention) passes whichever the installed one has."""
    try:
        import jax_triton
    except Exception as exc:  # noqa: BLE001 -- not importable is an answer, reported by the env part
        return f"not importable ({type(exc).__name__})"
    from benchmarks.gpu_check.triton_probe import output_keyword

    return f"takes {output_keyword(jax_triton)}= (jax-triton {getattr(jax_triton, '__version__', '?')})"


def _version(module: str) -> str:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        return f"missing ({type(exc).__name__})"


def environment(ctx: Context) -> Iterator[Row]:
    yield Row("env", "versions", "ok", {"python": platform.python_version(),
                                         **{m: _version(m) for m in _VERSIONS}})
    devices = jax.devices()
    stats = devices[0].memory_stats() or {}
    gib = lambda key: round(stats[key] / 2**30, 2) if key in stats else "n/a"  # noqa: E731
    yield Row("env", "device", "ok", {"platform": devices[0].platform, "count": len(devices),
                                       "kind": devices[0].device_kind, "limit GiB": gib("bytes_limit"),
                                       "in use GiB": gib("bytes_in_use")},
              data={"platform": devices[0].platform, "memory_stats": stats})
    yield guarded("env", "nvidia-smi", _nvidia_smi)
    on_gpu = devices[0].platform == "gpu"
    for module in IMPORTS:
        yield guarded("env", f"import {module}", functools.partial(_import_row, module))
    yield Row("env", "jax-triton call", "ok", {"triton_call": jax_triton_keyword()},
              note=f"PYTHONPATH first: {ctx.jax_triton_path}" if ctx.jax_triton_path else "")
    from jaxpaged.kernels.backends import resolve_backend
    for name in ("reference", "pallas", "triton", "pallas_triton"):
        try:
            yield Row("env", f"backend {name}", "ok", {"resolves to": resolve_backend(name)})
        except ValueError as exc:
            yield Row("env", f"backend {name}", "error" if on_gpu else "skip", note=str(exc))


def _import_row(module: str) -> Row:
    loaded = importlib.import_module(module)
    where = os.path.dirname(getattr(loaded, "__file__", "") or "")
    return Row("env", f"import {module}", "ok", {"version": getattr(loaded, "__version__", "-")}, note=where)


def _nvidia_smi() -> Row:
    if shutil.which("nvidia-smi") is None:
        return Row("env", "nvidia-smi", "skip", note="nvidia-smi not on PATH")
    fields = "name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu"
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        return Row("env", "nvidia-smi", "error", note=(out.stderr or out.stdout).strip()[:300])
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return Row("env", "nvidia-smi", "ok", dict(zip(fields.split(","), values)))


def jax_triton_probe(ctx: Context) -> Iterator[Row]:
    """Run by the driver once per candidate jax-triton folder (first on PYTHONPATH): an import row, then
    on a GPU a kernel row (a Triton add through triton_call)."""
    on_gpu = jax.devices()[0].platform == "gpu"
    try:
        import jax_triton
    except ImportError as exc:   # e.g. jax-triton 0.3 refuses a jaxlib without the CUDA plugin
        yield Row("jax-triton", "import", "error" if on_gpu else "skip", note=f"import failed: {exc}")
        return
    from benchmarks.gpu_check.triton_probe import output_keyword, run_add
    yield Row("jax-triton", "import", "ok", {"version": getattr(jax_triton, "__version__", "?"),
                                              "keyword": output_keyword(jax_triton)},
              note=os.path.dirname(jax_triton.__file__))
    if not on_gpu:
        yield Row("jax-triton", "kernel", "skip", note="no GPU: import only")
        return
    err = run_add()
    yield Row("jax-triton", "kernel", "ok" if err < 1e-6 else "fail", {"add max err": err})


def copy_bandwidth(ctx: Context) -> Iterator[Row]:
    """Device memory bandwidth: an elementwise op (bytes read plus bytes written), and a sum over rows
    (bytes read only: the rate a decode attention kernel, which reads KV and writes little, is held to)."""
    sizes = ctx.sizes
    x = random_normal(0, (sizes.copy_bytes // 2,), jnp.bfloat16)
    double = jax.jit(lambda a: a * 2)   # exact in bf16, and not an identity XLA could drop
    seconds = time_call(double, x, rounds=sizes.timing_rounds, round_s=sizes.timing_round_s)
    gbps = 2 * x.nbytes / seconds / 1e9
    yield Row("copy", f"x*2 bf16 {x.nbytes / 2**30:.3g} GiB", "ok", {"ms": seconds * 1e3, "GB/s (r+w)": gbps},
              data={"gbps": gbps, "bytes": x.nbytes, "seconds": seconds})
    rows = x.reshape(-1, 1024)
    row_sums = jax.jit(lambda a: a.sum(axis=1, dtype=jnp.float32))   # writes 1/512 of what it reads
    seconds = time_call(row_sums, rows, rounds=sizes.timing_rounds, round_s=sizes.timing_round_s)
    read_gbps = x.nbytes / seconds / 1e9
    yield Row("copy", f"row sums bf16 {x.nbytes / 2**30:.3g} GiB", "ok", {"ms": seconds * 1e3, "GB/s (read)": read_gbps},
              data={"read_gbps": read_gbps, "bytes": x.nbytes, "seconds": seconds})


def swap_round_trip(ctx: Context) -> Iterator[Row]:
    """The engine's HostSwapSpace: N blocks device -> pinned host -> other device blocks, bit-exact, GB/s."""
    sizes = ctx.sizes
    layers, kv_heads, block_size, head_dim = sizes.swap_shape
    n = sizes.swap_blocks
    shape = kv_pool_shape(layers, 2 * n + 1, block_size, kv_heads, head_dim)
    pool = random_normal(0, shape, jnp.bfloat16)
    space = HostSwapSpace(pool, n)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(np.arange(1, 2 * n + 1))
    out_ids, in_ids = blocks[:n], blocks[n:]              # swapped out from, swapped back in to (disjoint)
    host_ids = rng.permutation(np.arange(1, n + 1))
    expected = _take_blocks(pool, out_ids)                # a device copy, compared after the round trip
    block_bytes = pool.nbytes // shape[2]
    moved = n * block_bytes

    _wait_for_everything()
    out_times, in_times, host_kinds = [], [], set()
    for _ in range(sizes.timing_rounds):
        start = time.perf_counter()
        space.swap_out(pool, list(zip(out_ids.tolist(), host_ids.tolist())))
        _wait_for_everything()
        out_times.append(time.perf_counter() - start)
        host_kinds |= {a.sharding.memory_kind for a in jax.live_arrays()} - {"device", None}
        start = time.perf_counter()
        pool = space.swap_in(pool, list(zip(host_ids.tolist(), in_ids.tolist())))
        pool.block_until_ready()
        in_times.append(time.perf_counter() - start)
    exact = bool(_bit_equal(_take_blocks(pool, in_ids), expected))
    for direction, times in (("out", out_times), ("in", in_times)):
        seconds = statistics.median(times)
        yield Row("swap", f"swap-{direction} {n} blocks", "ok" if exact else "fail",
                  {"MiB": moved / 2**20, "ms": seconds * 1e3, "GB/s": moved / seconds / 1e9, "bit-exact": exact},
                  note=f"host arrays in {', '.join(sorted(host_kinds)) or 'no host memory'}; block {block_bytes} B "
                       f"({layers} layers)", data={"seconds": times, "bytes": moved})


def _wait_for_everything() -> None:
    """Block until all queued device work is done: swap-out returns nothing of its own to wait on."""
    for array in jax.live_arrays():
        array.block_until_ready()



@functools.partial(jax.jit, static_argnums=(1, 2))
def random_normal(seed: int, shape: tuple[int, ...], dtype) -> jax.Array:
    # rbg: threefry's generator compiles for seconds on CPU, which the dry run pays for every shape
    return jax.random.normal(jax.random.key(seed, impl="rbg"), shape, dtype)


@jax.jit
def _take_blocks(pool: jax.Array, block_ids) -> jax.Array:
    return pool[:, :, block_ids]


@jax.jit
def _bit_equal(a: jax.Array, b: jax.Array) -> jax.Array:
    """Bit-for-bit equality (NaN payloads included), not value equality."""
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
    return jnp.array_equal(bits(a), bits(b))
