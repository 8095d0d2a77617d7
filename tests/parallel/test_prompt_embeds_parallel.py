"""Prompt embeddings on a mesh (8 forced CPU devices, in a subprocess): tensor parallelism shards the
embedding table the rows stand in for, and data parallelism routes a repeated prompt of rows to the replica
that holds its blocks; the tokens are those of one device."""

from tests.parallel.layout_checks import run_on_eight_devices

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
    result = run_on_eight_devices(["-c", SCRIPT])
    one, mesh = result["1x1"], result["2x2"]
    assert mesh["tokens"] == one["tokens"]
    assert mesh["cached"] == one["cached"] == 32 and mesh["again"] == one["tokens"][1]
