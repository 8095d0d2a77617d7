"""Images on a mesh (8 forced CPU devices, in a subprocess): with tensor parallelism the image rows stand in
for a sharded embedding table, and data parallelism runs each replica's own tower; the tokens are those of one
device (LLaVA's, and Qwen2-VL's with its M-RoPE positions)."""

from tests.parallel.layout_checks import run_on_eight_devices

SCRIPT = r"""
import json
from jaxpaged import LLM, SamplingParams
from tests.engine.test_images import image, llava
from tests.engine.test_images_qwen import PLACEHOLDER, qwen_vl

prompts = [{"prompt": "USER: <image>\nwhat is it? ASSISTANT:", "multi_modal_data": {"image": image(1)}},
           {"prompt": "<image> and <image>?", "multi_modal_data": {"image": [image(2), image(3, (50, 20))]}},
           "text alone"]
qwen_prompts = [{"prompt": f"{PLACEHOLDER}{PLACEHOLDER} which?",   # (M-RoPE positions)
                 "multi_modal_data": {"image": [image(2, (60, 90)), image(3, (150, 60))]}}, "text alone"]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
out = {}
for name, (path, _), asked in (("llava", llava(), prompts), ("qwen", qwen_vl("qwen2_vl"), qwen_prompts)):
    for tp, dp in ((1, 1), (2, 2)):
        llm = LLM(path, dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp, block_size=8,
                  num_gpu_blocks_override=32, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128,
                  compile_on_startup=False, use_tqdm=False)
        out[f"{name} {tp}x{dp}"] = [o.outputs[0].token_ids for o in llm.generate(asked, params, use_tqdm=False)]
print("RESULT " + json.dumps(out))
"""


def test_images_under_tensor_and_data_parallelism():
    result = run_on_eight_devices(["-c", SCRIPT])
    for name in ("llava", "qwen"):
        assert result[f"{name} 2x2"] == result[f"{name} 1x1"]
        assert all(len(tokens) == 8 for tokens in result[f"{name} 1x1"])
