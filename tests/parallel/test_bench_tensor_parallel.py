"""`jaxpaged bench throughput --tensor-parallel-size 2` runs (on 8 forced CPU devices)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_throughput_benchmark_runs_tensor_parallel():
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint("llama", num_key_value_heads=4)
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.cli", "bench", "throughput", "--tensor-parallel-size", "2",
                           "--model", path, "--skip-hf", "--num-requests", "4", "--max-num-seqs", "4",
                           "--max-num-batched-tokens", "64"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tensor_parallel_size 2" in proc.stdout
    assert "jaxpaged " in proc.stdout and "steps:" in proc.stdout
