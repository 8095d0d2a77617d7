"""Offline throughput benchmark; see jaxpaged/bench/throughput.py (also `jaxpaged bench throughput`)."""

from jaxpaged.bench.throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
