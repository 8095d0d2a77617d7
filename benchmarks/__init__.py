"""Repository tools, not installed: micro-benchmarks (`python -m benchmarks.<name>` from the repository's
root) and the GPU check (benchmarks/gpu_check, run by scripts/gpu_check.sh). The benchmarks a user runs,
`jaxpaged bench throughput|serve`, are in the package: jaxpaged/benchmarks/."""
