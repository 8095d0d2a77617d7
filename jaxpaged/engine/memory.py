"""How many KV-cache blocks fit on a GPU: `gpu_memory_utilization` of the device's memory.

    budget    = gpu_memory_utilization x the device's total memory
    usable    = min(budget, what JAX's allocator may hand out)
    KV cache  = usable - bytes in use (weights, other live arrays) - the largest step's activations
                - headroom (1% of usable)

JAX's GPU allocator (XLA_PYTHON_CLIENT_ALLOCATOR, default BFC) never hands out more than
`mem_fraction x total` (XLA_CLIENT_MEM_FRACTION or the older XLA_PYTHON_CLIENT_MEM_FRACTION,
default 0.75), whether it preallocates that pool (XLA_PYTHON_CLIENT_PREALLOCATE, default
true) or grows into it; `memory_stats()["bytes_limit"]` is that cap, not the device. The
fraction is read once, when JAX starts its GPU backend, so the engine sets it to
`gpu_memory_utilization` itself when JAX has not started yet (`preset_mem_fraction`), and
otherwise sizes the cache to the cap with a warning saying what to set.

The activations come from the compiled step's own memory analysis at the largest buckets,
compiled against a 2-block pool: the pool is updated in place (donated), so the step's
temporary bytes do not depend on the pool's size (tests/engine/test_memory_sizing.py checks it).

The headroom is for what the analysis does not see. On an H200 (Qwen2.5-0.5B shape, default
arguments), a pool that leaves exactly the analysed 1.24 GiB fails the first step, which cannot
allocate the sampler's 890 MiB: something the analysis does not count (allocator fragmentation,
a program's runtime buffers; which one is unknown) holds the difference. The GPU check's start-up
row reports the allocator's statistics after start-up to tell them apart.
"""

import ctypes
import dataclasses
import os

import jax

GiB = 1 << 30
HEADROOM_FRACTION = 0.01               # of the usable memory, left free beside the pool and the step
DEFAULT_MEM_FRACTION = 0.75            # XLA's GpuAllocatorConfig default
FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")   # new name first
FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"   # the one we set and name: every jaxlib reads it
POOLED_ALLOCATORS = ("default", "bfc", "cuda_async")   # those capped at mem_fraction x total


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """JAX's GPU allocator settings, as its GPU backend reads them from the environment."""

    kind: str               # XLA_PYTHON_CLIENT_ALLOCATOR: default (BFC) | bfc | cuda_async | platform | ...
    preallocate: bool       # XLA_PYTHON_CLIENT_PREALLOCATE
    mem_fraction: float     # of the device's total memory a pooled allocator may use
    fraction_var: str | None  # the variable that set mem_fraction; None: XLA's default

    @classmethod
    def from_env(cls, environ=os.environ) -> "AllocatorConfig":
        kind = environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
        preallocate = environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "") not in ("false", "False", "0")
        for var in FRACTION_VARS:
            if environ.get(var):
                return cls(kind, preallocate, float(environ[var]), var)
        return cls(kind, preallocate, DEFAULT_MEM_FRACTION, None)

    @property
    def is_pooled(self) -> bool:
        return self.kind in POOLED_ALLOCATORS


def preset_mem_fraction(gpu_memory_utilization: float, environ=os.environ, jax_started: bool | None = None,
                        platforms: str | None = None) -> str | None:
    """Set XLA_PYTHON_CLIENT_MEM_FRACTION to `gpu_memory_utilization` when JAX's backends have
    not started yet and nobody chose a fraction; changes `environ` and returns a line to log,
    or None when it changed nothing (JAX started, the user's own value, a CPU-only JAX).

    `jax_started` and `platforms` default to JAX's own state and `jax_platforms` setting."""
    config = AllocatorConfig.from_env(environ)
    if config.fraction_var is not None or not config.is_pooled:
        return None
    platforms = jax.config.jax_platforms if platforms is None else platforms
    if platforms and not {"cuda", "gpu", "rocm"} & set(platforms.split(",")):
        return None
    if _backends_initialized() if jax_started is None else jax_started:
        return None
    environ[FRACTION_VAR] = repr(float(gpu_memory_utilization))
    return f"set {FRACTION_VAR}={environ[FRACTION_VAR]} (gpu_memory_utilization) before JAX starts"


def _backends_initialized() -> bool:
    try:
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:   # cannot tell: assume JAX has started and the fraction is fixed
        return True
    return backends_are_initialized()


# ---- what the device reports ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryReport:
    total_bytes: int                  # the device's memory
    bytes_in_use: int                 # live arrays: the weights and anything else loaded
    allocator_limit: int | None       # the most JAX's allocator hands out; None: no cap below the device
    largest_free_block: int | None    # preallocated pool only: the KV pool is one allocation


def has_device_memory(device) -> bool:
    """False on CPU, whose KV cache takes a fixed share of host memory instead."""
    return device.platform != "cpu"


def memory_stats(device) -> dict:
    return device.memory_stats() or {}


def driver_total_bytes(device) -> int | None:
    """The device's memory from the CUDA driver (cuDeviceTotalMem), or None without one."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    handle, size = ctypes.c_int(), ctypes.c_size_t()
    ordinal = device.local_hardware_id if device.local_hardware_id is not None else device.id
    if (cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(handle), ordinal) != 0
            or cuda.cuDeviceTotalMem_v2(ctypes.byref(size), handle) != 0):
        return None
    return size.value


def read_memory_report(device, allocator: AllocatorConfig) -> MemoryReport:
    stats = memory_stats(device)
    limit = stats.get("bytes_limit", 0)
    limit = limit if limit > 0 else None
    total = driver_total_bytes(device)
    if total is None and limit is not None and allocator.is_pooled:
        total = round(limit / allocator.mem_fraction)   # the pool is mem_fraction x total
    if total is None:
        raise ValueError(f"cannot tell how much memory {device} has (allocator {allocator.kind!r} reports no "
                         "limit and the CUDA driver is not reachable): pass kv_cache_memory_bytes or "
                         "num_gpu_blocks_override")
    if "bytes_in_use" in stats:
        in_use = stats["bytes_in_use"]
    else:   # the platform allocator keeps no statistics
        in_use = sum(a.nbytes for a in jax.live_arrays() if device in a.devices())
    free = stats.get("largest_free_block_bytes", 0)
    free = free if free > 0 and allocator.preallocate and allocator.is_pooled else None
    return MemoryReport(total, in_use, limit, free)


# ---- what the step needs -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepMemory:
    temp_bytes: int      # the compiled step's temporaries
    input_bytes: int     # its inputs besides the weights, the pool and the persistent batch
    output_bytes: int    # its outputs besides the pool and the persistent batch (aliased to donated inputs)
    state_bytes: int = 0  # the persistent batch (block tables, sampling and penalty state), held once

    @property
    def reserve_bytes(self) -> int:
        """What to leave free beside the pool. Inputs and outputs count twice: the previous
        step's outputs are held while the next runs (async scheduling), and the runner may
        keep each bucket's inputs resident; buckets double, so all smaller buckets together
        hold less than the largest."""
        return self.temp_bytes + 2 * self.input_bytes + 2 * self.output_bytes + self.state_bytes


def largest_buckets(shapes) -> list:
    """Per query tile (decode-only, prefill), the bucket with the most tokens, then sequences."""
    by_tile = {}
    for s in shapes:
        by_tile.setdefault(s.q_tile, []).append(s)
    return [max(group, key=lambda s: (s.num_tokens, s.num_seqs, s.num_logits)) for group in by_tile.values()]


def step_memory(runner, shape) -> StepMemory:
    """Memory analysis of `runner`'s step compiled for `shape`, its forward and sampler together
    (compiles; runs nothing). Their temporaries count together: the sampler is queued right
    behind the forward, and the next step's forward behind it (async scheduling); whether the
    GPU allocator lets a queued program reuse the one before's temporaries is not measured."""
    forward, samplers, prompt = runner.programs(shape)
    analyses = [c.memory_analysis() for c in (forward, *samplers, *([prompt] if prompt is not None else []))]
    if any(a is None for a in analyses):
        raise ValueError("this backend gives no memory analysis of the compiled step: pass "
                         "kv_cache_memory_bytes or num_gpu_blocks_override")
    forward, samplers, prompt = analyses[0], analyses[1:1 + len(samplers)], analyses[1 + len(samplers):]
    # a step runs one of its samplers (host_branches: one of three kinds), and prompt logprobs (when
    # asked) after the forward
    sampler = max(samplers, key=lambda a: a.temp_size_in_bytes)
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.state) if hasattr(x, "nbytes"))
    state = runner.slot_state.nbytes
    # the sampler's inputs besides the weights and the persistent batch are the forward's outputs
    pool = runner.kv_pool_spec.size * runner.kv_pool_spec.dtype.itemsize
    inputs = forward.argument_size_in_bytes - weights - pool - state
    outputs = sum(a.output_size_in_bytes - a.alias_size_in_bytes for a in (forward, sampler))
    temp = forward.temp_size_in_bytes + sampler.temp_size_in_bytes + sum(a.temp_size_in_bytes for a in prompt)
    return StepMemory(temp, max(inputs, 0), max(outputs, 0), state)


def step_reserve_bytes(runner) -> int:
    """The most any of `runner`'s largest buckets needs beside the weights and the pool."""
    return max(step_memory(runner, s).reserve_bytes for s in largest_buckets(runner.warmup_shapes()))


# ---- the decision --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KVCacheSizing:
    num_blocks: int
    kv_cache_bytes: int
    warning: str | None     # set when the allocator's cap, not gpu_memory_utilization, decided


def size_kv_cache(report: MemoryReport, allocator: AllocatorConfig, gpu_memory_utilization: float,
                  bytes_per_block: int, activation_bytes: int, max_num_batched_tokens: int) -> KVCacheSizing:
    """Pure: how many blocks fit. Raises ValueError when fewer than 2 do."""
    budget = int(gpu_memory_utilization * report.total_bytes)
    usable, warning = budget, None
    if report.allocator_limit is not None and report.allocator_limit + (1 << 20) < budget:
        usable = report.allocator_limit
        started = (f"{allocator.fraction_var}={allocator.mem_fraction:g}" if allocator.fraction_var else
                   f"its default memory fraction {allocator.mem_fraction:g} ({FRACTION_VAR} unset)")
        warning = (f"gpu_memory_utilization={gpu_memory_utilization:g} asks for {_gib(budget)} of the device's "
                   f"{_gib(report.total_bytes)}, but JAX's allocator ({allocator.kind}) was started with {started} "
                   f"and hands out at most {_gib(usable)}: the KV cache is sized to that. To use "
                   f"{gpu_memory_utilization:g} of the device, set {allocator.fraction_var or FRACTION_VAR}="
                   f"{gpu_memory_utilization:g} "
                   "before JAX starts (or create the LLM before any other JAX work; in a notebook, restart "
                   "the runtime)")
    kv_bytes = usable - report.bytes_in_use - activation_bytes - headroom_bytes(usable)
    if report.largest_free_block is not None:
        kv_bytes = min(kv_bytes, report.largest_free_block)
    if kv_bytes < 2 * bytes_per_block:
        raise ValueError(
            f"no device memory left for the KV cache: gpu_memory_utilization={gpu_memory_utilization:g} of "
            f"{_gib(report.total_bytes)} gives {_gib(usable)}"
            + (f" (capped by JAX's allocator; see {FRACTION_VAR})" if warning else "")
            + f"; the weights and other arrays use {_gib(report.bytes_in_use)} and the largest step "
            f"(max_num_batched_tokens={max_num_batched_tokens}) needs {_gib(activation_bytes)} and "
            f"{_gib(headroom_bytes(usable))} stays free, leaving "
            f"{_gib(max(kv_bytes, 0))}, under 2 blocks of {bytes_per_block} B. Raise gpu_memory_utilization "
            "(at most 1), lower max_num_batched_tokens or max_num_seqs, or use a smaller model or dtype")
    return KVCacheSizing(kv_bytes // bytes_per_block, kv_bytes, warning)


def headroom_bytes(usable: int) -> int:
    """Memory left free beside the weights, the pool and the analysed step (see the module's doc)."""
    return int(HEADROOM_FRACTION * usable)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
