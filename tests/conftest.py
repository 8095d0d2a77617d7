"""Suite-wide settings and hygiene, applied before any test module imports jax.

Every compiled XLA:CPU program keeps memory mappings of its own, and a test worker runs many
engines: a worker of the full suite reached ~39,000 of the kernel's 65,530 (`vm.max_map_count`)
and crossing it made XLA abort or segfault in whatever compiled next. So after each test module
the compiled programs of its engines are let go (engines collected, jax's caches cleared), and
the persistent compilation cache, shared by every worker and subprocess, is off in tests.
"""

import gc
import os

import pytest

os.environ.setdefault("JAXPAGED_COMPILATION_CACHE", "0")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    import jax
    gc.collect()
    jax.clear_caches()
    gc.collect()
