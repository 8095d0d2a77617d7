"""The earlier import path of jaxpaged.benchmarks, kept as an alias: `python -m jaxpaged.bench.throughput`
and `python -m jaxpaged.bench.serve` run the same benchmarks as `jaxpaged bench throughput|serve`."""
