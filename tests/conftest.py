"""Suite-wide settings and hygiene, applied before any test module imports jax.

Every compiled XLA:CPU program keeps memory mappings of its own, and a test worker runs many
engines: a worker of the full suite reached ~39,000 of the kernel's 65,530 (`vm.max_map_count`)
and crossing it made XLA abort or segfault in whatever compiled next. So after each test module
the compiled programs of its engines are let go (engines collected, jax's caches cleared).

Compilation is most of the tiny-model tests' time (they run in milliseconds, their step variants
compile in seconds), so the persistent compilation cache is one folder for this run only, shared by
both test processes and every subprocess (notebook kernels, servers, workers) and removed at the
end: the same program compiled again by another engine, test or process is read back (even the
quick ones: JAXPAGED_COMPILATION_CACHE_MIN_SECS=0), and no run sees an older run's programs.
And engines compile at optimization_level 0 unless a test asks for another (JAXPAGED_OPTIMIZATION_LEVEL,
also inherited by every subprocess): XLA's code generation unoptimized, which cut two tiny-model
files from 81 to 56 s (test_llm_generate, test_beam_search, empty caches). The built-in model's
engines and the notebooks ask for 2 (tests/fixtures_smollm2.py: their steps' compute outweighs it).
"""

import atexit
import contextlib
import gc
import os
import shutil
import sys
import tempfile
import threading

import pytest

# Where PYTHONDONTWRITEBYTECODE is set (a shell may set it), no process keeps the bytecode of the
# repo's modules nor pytest its rewritten test modules: every test process and every subprocess (notebook
# kernels, servers, workers: dozens) compiles them again, and in a fresh clone there is none to read.
# Collection takes 12.5 s against 8.8 s with it kept (a fresh clone, one core). The suite keeps it (in the
# __pycache__ folders git ignores; imports before this point, pytest's plugins, are not cached).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Every other program the tests compile (their own jits of models, kernels and samplers, and the
# subprocesses' that inherit it) at LLVM's level 0 too; an engine's steps keep their optimization_level,
# which it always passes explicitly. test_llama_family: 300 -> 201 s.
SUITE_XLA_FLAG = "--xla_backend_optimization_level=0"

if "PYTEST_XDIST_WORKER" not in os.environ and "JAXPAGED_COMPILATION_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxpaged-test-jax-cache-")   # the test processes inherit it
    os.environ["JAXPAGED_COMPILATION_CACHE"] = _cache
    os.environ.setdefault("JAXPAGED_COMPILATION_CACHE_MIN_SECS", "0")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAXPAGED_OPTIMIZATION_LEVEL", "0")   # see above; a test may pass optimization_level
if SUITE_XLA_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SUITE_XLA_FLAG).strip()

# Each test process on cores of its own (every process it starts inherits them): XLA sizes its thread
# pools from the process's affinity, so the two processes' pools do not both spread over both cores.
# Measured on 2 cores: the run's CPU seconds 1,651 -> 1,394 (the notebooks' 215 -> 128), pytest 14:36 -> 12:25.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    _count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _count <= len(_cores):   # more processes than cores: they share them anyway
        # the cores split as evenly as they go (3 cores, 2 processes: 1 and 2); a process xdist starts in place of
        # one that crashed (gw2 of 2) takes the crashed one's share
        _index = int(_WORKER[2:]) % _count
        os.sched_setaffinity(0, _cores[_index * len(_cores) // _count:(_index + 1) * len(_cores) // _count])

# The files that take more than ~30 s of a core (a full run's CPU seconds per file), longest first:
# pytest-xdist hands whole files to the test processes as they free up, in collection order
# (pyproject: --dist loadfile --no-loadscope-reorder), and with the longest started first the last
# files handed out are short ones, so both processes finish together (its own order, most tests
# first, leaves the one-test notebook and GPU-check files to the end: one process runs 36 s longer).
LONGEST_FILES = [
    "tests/notebooks/test_notebooks.py", "tests/models/test_quantized_accuracy.py",
    "tests/engine/test_spec_decode.py", "tests/scripts/test_gpu_check.py", "tests/engine/test_attention_backends.py",
    "tests/engine/test_quantized_engine.py", "tests/parallel/test_layouts_quantized.py",
    "tests/models/test_quantization.py", "tests/kernels/test_pallas_attention.py", "tests/models/test_llama_family.py",
    "tests/parallel/test_multihost.py", "tests/parallel/test_spec_decode_layouts.py",
    "tests/engine/test_host_branches.py", "tests/parallel/test_layouts_llama.py", "tests/parallel/test_layouts_moe.py",
    "tests/parallel/test_layouts_qwen.py",
]


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
assert all(os.path.isfile(os.path.join(_ROOT, name)) for name in LONGEST_FILES), "LONGEST_FILES names a moved file"


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))   # stable: files stay whole


# Python's cyclic garbage collector: a test process holds millions of objects (jax, torch, transformers,
# the test modules), and each full collection walks them all (0.2-0.35 s, several a file). Collections
# are rarer here (a young generation of 10,000 objects, not 700), what was imported before the first
# test is frozen out of them (pytest_collection_finish), and a module's end collects once, not twice.
# test_llama_family + test_llm_generate + test_beam_search on one core: the collector's time 3.8 -> 0.9 s,
# the files' CPU seconds 73.2 -> 62.0 and 78.4 -> 71.6 (two runs each way, alternated).
gc.set_threshold(10_000, 10, 10)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    _start_xla_compile_threads_then_yield()


# XLA:CPU (jaxlib 0.11) hands each fusion of a program to its compile threads with an MLIR context from a
# pool, and builds a new context (every dialect loaded, every pass set up) when none is free. At one priority
# the thread emitting the fusions (a test's, or engine start-up's compile threads, which inherit its priority)
# runs ahead of the compile threads, and nearly every fusion gets a new context (perf probes: 68 of 74). So
# each test process starts XLA's compile threads at its own priority (they start with its first compile), then
# puts its test thread at a low one: XLA's threads then run whenever they have work and hand their contexts back.
# `taskset -c 0 pytest -q -n 0 tests/models/test_llama_family.py tests/engine/test_llm_generate.py
# tests/engine/test_beam_search.py` with this (start-up's threads inherit the test thread's 18) against
# TEST_THREAD_NICE = 0, alternated (2026-12-06): 62.3 and 58.1 s against 83.9 and 83.9 s. This is the
# suite's concern only: the product's threads keep the priority their caller gives them.
TEST_THREAD_NICE = 18


def _start_xla_compile_threads_then_yield():
    import jax

    jax.jit(lambda x: x + os.getpid())(0)   # a program no cache holds, so it does compile here
    if sys.platform.startswith("linux"):   # a thread's own priority (elsewhere the id would be a process's)
        with contextlib.suppress(OSError):   # a sandbox refusing it: the tests only take longer
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TEST_THREAD_NICE)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import jax
    jax.clear_caches()   # first: a collection then frees the engines and the executables those caches held
    gc.collect()


# XLA:CPU maps each program it compiles into memory mappings of its own (about a thousand for a tiny model's
# step programs), and JAX's caches keep every program until they are cleared: past the kernel's
# vm.max_map_count (65530 by default) the next mapping fails and XLA segfaults inside a compile (seen in
# tests/engine/test_model_families.py, one file building some sixty engines). A test that leaves its process
# holding more than 60% of the limit clears them then, as the module fixture above does at a file's end.
def _mapping_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) * 6 // 10
    except (OSError, ValueError):   # not Linux: no such limit to keep under
        return 0


MAPPING_LIMIT = _mapping_limit()


@pytest.fixture(autouse=True)
def _bound_memory_mappings():
    yield
    if MAPPING_LIMIT:
        with open("/proc/self/maps") as f:
            mappings = sum(1 for _ in f)
        if mappings > MAPPING_LIMIT:
            import jax
            jax.clear_caches()
            gc.collect()
