"""Suite-wide settings, applied before any test module imports jax.

The persistent compilation cache is off in tests: XLA:CPU's executable (de)serialization aborted or
segfaulted the test processes now and then under the suite's load (six crashes in six full runs of
this session, inside `compilation_cache.put_executable_and_time` / `get_executable_and_time` or right
after), and a cache shared by every worker and subprocess also couples tests that should not be.
"""

import os

os.environ.setdefault("JAXPAGED_COMPILATION_CACHE", "0")
