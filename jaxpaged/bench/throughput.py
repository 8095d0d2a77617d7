"""Alias of jaxpaged.benchmarks.throughput (kept for commands that name jaxpaged.bench)."""

from jaxpaged.benchmarks.throughput import *  # noqa: F401,F403
from jaxpaged.benchmarks.throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
