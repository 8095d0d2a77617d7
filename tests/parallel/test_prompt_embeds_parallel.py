"""Prompt embeddings on a mesh (8 forced CPU devices, in a subprocess): tensor parallelism shards the
embedding table the rows stand in for, and data parallelism routes a repeated prompt of rows to the replica
that holds its blocks; the tokens are those of one device."""

import json
import os
import subprocess
import sys

from tests.parallel.layout_checks import ROOT

SCRIPT = r"""
import json
import numpy as np
from jaxpaged import LLM, SamplingParams
from tests.engine.test_prompt_embeds import hf_rows
from tests.tiny_models import tiny_checkpoint

rng = np.random.default_rng(4)
prompts = [rng.integers(3, 300, n).tolist() for n in (21, 40, 9)]
params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
out = {}
for tp, dp in ((1, 1), (2, 2)):
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp,
              block_size=8, num_gpu_blocks_override=24, max_num_batched_tokens=32, max_num_seqs=4,
              compile_on_startup=False, enable_prompt_embeds=True, use_tqdm=False)
    rows = [{"prompt_embeds": hf_rows("llama", p)} for p in prompts]
    first = llm.generate(rows, params, use_tqdm=False)
    again = llm.generate(rows[1:2], params, use_tqdm=False)[0]   # to the replica holding its blocks (2x2: rank 1)
    out[f"{tp}x{dp}"] = {"tokens": [o.outputs[0].token_ids for o in first], "cached": again.num_cached_tokens,
                         "again": again.outputs[0].token_ids}
print("RESULT " + json.dumps(out))
"""


def test_prompt_embeds_under_tensor_and_data_parallelism():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    one, mesh = result["1x1"], result["2x2"]
    assert mesh["tokens"] == one["tokens"]
    assert mesh["cached"] == one["cached"] == 32 and mesh["again"] == one["tokens"][1]
