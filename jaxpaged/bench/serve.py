"""Alias of jaxpaged.benchmarks.serve (kept for commands that name jaxpaged.bench)."""

from jaxpaged.benchmarks.serve import *  # noqa: F401,F403
from jaxpaged.benchmarks.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
