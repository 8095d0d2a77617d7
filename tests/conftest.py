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
files from 81 to 56 s (test_llm_generate, test_beam_search, empty caches) and left the built-in
model's test_smollm2 within 6% (67 against 71 s).
"""

import atexit
import gc
import os
import shutil
import tempfile

import pytest

if "PYTEST_XDIST_WORKER" not in os.environ and "JAXPAGED_COMPILATION_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxpaged-test-jax-cache-")   # the test processes inherit it
    os.environ["JAXPAGED_COMPILATION_CACHE"] = _cache
    os.environ.setdefault("JAXPAGED_COMPILATION_CACHE_MIN_SECS", "0")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAXPAGED_OPTIMIZATION_LEVEL", "0")   # see above; a test may pass optimization_level


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import jax
    gc.collect()
    jax.clear_caches()
    gc.collect()
