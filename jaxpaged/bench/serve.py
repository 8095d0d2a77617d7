"""Alias of jaxpaged.benchmarks.serve (the earlier import path)."""

from jaxpaged.benchmarks.serve import *  # noqa: F401,F403
from jaxpaged.benchmarks.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
