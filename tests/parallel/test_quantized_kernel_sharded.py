"""The W8A16 / W4A16 kernel under tensor parallelism (8 forced CPU devices, in a subprocess; the
kernel in interpret mode): per shard under shard_map, column-parallel weights give their output
columns, row-parallel ones partial sums added over the devices, and replicated ones (an FP8 DeepSeek
checkpoint's latent-attention projections) the whole product; the logits are the single device's
de-quantizing path's."""

import json
import os
import subprocess
import sys

import pytest

from tests.parallel.layout_checks import ROOT

SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, numpy as np
from jaxpaged.parallel import ShardPlan
from tests.models.test_quantization import forward_logits
from tests.parallel.worker import allow_concurrent_gpu_interpret
from tests.tiny_models import tiny_checkpoint
allow_concurrent_gpu_interpret()
tokens = np.random.default_rng(5).integers(3, 320, 40).tolist()
out = {}
for mode in sys.argv[1:]:
    if mode == "deepseek_v3-fp8":   # q_a_proj kept FP8 (blocks of 32, as the kernel takes) and replicated
        from tests.models.test_prequantized import checkpoints
        path = checkpoints("fp8-blocks", "deepseek_v3", ("q_a_proj",), 32, q_lora_rank=32)[0]
        quantization = "auto"
    else:
        path, quantization = tiny_checkpoint("llama"), mode
    ref, _ = forward_logits(path, tokens, quantized_matmul="reference", quantization=quantization)
    for tp in (1, 2):
        plan = ShardPlan.for_devices(jax.devices()[:tp]) if tp > 1 else ShardPlan()
        got, loaded = forward_logits(path, tokens, quantized_matmul="pallas", quantization=quantization,
                                     shard_plan=plan)
        out[f"{mode} tp={tp}"] = float(np.abs(got - ref).max() / np.abs(ref).max())
print("RESULT " + json.dumps(out))
"""


MODES = ["int8", "int4", "deepseek_v3-fp8"]


@pytest.fixture(scope="module")
def errors():
    """Both modes in one subprocess (one start-up, one checkpoint)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", SCRIPT, *MODES], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("mode", MODES)
def test_the_kernel_per_shard_gives_the_single_device_logits(mode, errors):
    assert errors[f"{mode} tp=1"] < 1e-4 and errors[f"{mode} tp=2"] < 1e-4, errors
