"""Images on a mesh (8 forced CPU devices, in a subprocess): with tensor parallelism the image rows stand in
for a sharded embedding table, and data parallelism runs each replica's own tower; the tokens are those of one
device."""

import json
import os
import subprocess
import sys

from tests.parallel.layout_checks import ROOT

SCRIPT = r"""
import json
from jaxpaged import LLM, SamplingParams
from tests.engine.test_images import image, llava

path, _ = llava()
prompts = [{"prompt": "USER: <image>\nwhat is it? ASSISTANT:", "multi_modal_data": {"image": image(1)}},
           {"prompt": "<image> and <image>?", "multi_modal_data": {"image": [image(2), image(3, (50, 20))]}},
           "text alone"]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
out = {}
for tp, dp in ((1, 1), (2, 2)):
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp, block_size=8,
              num_gpu_blocks_override=32, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128,
              compile_on_startup=False, use_tqdm=False)
    out[f"{tp}x{dp}"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print("RESULT " + json.dumps(out))
"""


def test_images_under_tensor_and_data_parallelism():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["2x2"] == result["1x1"]
    assert all(len(tokens) == 8 for tokens in result["1x1"])
