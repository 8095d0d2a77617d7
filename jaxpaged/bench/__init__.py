"""An alias of jaxpaged.benchmarks, kept for commands that name it: `python -m jaxpaged.bench.throughput`
and `python -m jaxpaged.bench.serve` run the same benchmarks as `jaxpaged bench throughput|serve`."""
