"""Alias of jaxpaged.benchmarks.throughput (the earlier import path)."""

from jaxpaged.benchmarks.throughput import *  # noqa: F401,F403
from jaxpaged.benchmarks.throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
