"""Checks of tensor and data parallelism on 8 forced CPU devices (a subprocess per model: the
device count is fixed when jax starts): the same greedy tokens and logprobs as one device, from
the original checkpoint and from its `jaxpaged convert` orbax folder, weights and KV pool really
sharded, requests spread over replicas and metrics summed. One test file per model or two
(test_layouts_*.py): the test processes share the files, and a file's models share one subprocess."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDED = ("wqkv", "wo", "w_gate_up", "w_up", "w_down", "embed", "lm_head", "lm_head_bias",
           "bqkv", "b_gate_up", "b_up",   # column biases
           "w_experts_gate_up", "w_experts_down", "b_experts_gate_up", "b_experts_down",   # experts: expert parallelism
           "sinks",   # gpt-oss's attention sinks, with their query heads
           "wq", "wq_b", "w_uk", "w_uv")   # latent attention's heads (its latent projection is replicated)

# arch, config overrides, layouts (tp, dp): MHA, GQA with q/k/v bias, MQA with q/k norm
# every layout for llama; the tensor-parallel ones for the others (data parallelism runs
# whole replicas, whatever the architecture); then the layouts a `jaxpaged convert` folder is
# restored into, and those run with the Pallas kernel (interpret mode on CPU) under shard_map
LAYOUTS = [[1, 1], [2, 1], [4, 1], [1, 2], [2, 2]]
TENSOR_PARALLEL = [[1, 1], [2, 1], [4, 1]]
CASES = {
    "llama-mha": ("llama", {"num_key_value_heads": 4}, LAYOUTS, [[1, 1], [2, 1]], []),
    "qwen2-gqa": ("qwen2", {"head_dim": 32}, TENSOR_PARALLEL, [], [[2, 1]]),   # head_dim 32: the Mosaic kernel in fp32
    "qwen3-mqa": ("qwen3", {"num_key_value_heads": 1}, TENSOR_PARALLEL, [[2, 1]], []),
    # q/k norms over all heads at once (an all-device reduction under tensor parallelism), no pre-norms
    "olmo2-tp": ("olmo2", {}, [[1, 1], [2, 1]], [], []),
    # experts sharded over the devices; qwen2_moe: a shared expert and a dense layer (unrolled layers)
    "mixtral-ep": ("mixtral", {}, [[1, 1], [4, 1]], [[2, 1]], []),
    "qwen2_moe-ep": ("qwen2_moe", {}, [[1, 1], [2, 1]], [], []),
    # gpt-oss: each device's attention sinks with its query heads, the experts' biases with the experts
    "gpt_oss-ep": ("gpt_oss", {}, [[1, 1], [2, 1]], [], []),
    # latent attention: query heads split, each device its copy of the latent (one KV head repeated);
    # DeepSeek-V3's grouped sigmoid routing with its f32 correction bias, shared experts split by columns
    "deepseek_v3-tp": ("deepseek_v3", {}, [[1, 1], [2, 1]], [], []),
    # MiniMax-M2: q/k norms over all heads under tensor parallelism, sigmoid routing with its choice bias
    "minimax_m2-ep": ("minimax_m2", {}, [[1, 1], [2, 1]], [], []),
    # GLM-4: q/k rows reordered for its interleaved partial rope before they are split, its four norms
    "glm4-tp": ("glm4", {}, [[1, 1], [2, 1]], [], []),
    # GPT-2: learned positions (restored from a converted folder too), Conv1D weights, an ungated MLP, norm biases;
    # GPT-NeoX: its per-head fused q/k/v split before the heads are, the parallel block's two norms
    "gpt2-tp": ("gpt2", {}, [[1, 1], [2, 1]], [[2, 1]], []),
    "gpt_neox-tp": ("gpt_neox", {}, [[1, 1], [2, 1]], [], []),
    # GPT-J: q/k rows reordered for its interleaved partial rope, its LM head's bias split with the vocabulary
    "gptj-tp": ("gptj", {}, [[1, 1], [2, 1]], [[2, 1]], []),
}


def run_on_eight_devices(argv: list[str]):
    """`python *argv` from the repository root with 8 forced CPU devices: its last "RESULT <json>" line, parsed."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def run_worker(spec: dict | list[dict]) -> dict | list[dict]:
    return run_on_eight_devices(["-m", "tests.parallel.worker", json.dumps(spec)])


def case_spec(name: str) -> dict:
    arch, overrides, layouts, orbax_layouts, pallas_layouts = CASES[name]
    return {"arch": arch, "overrides": overrides, "layouts": layouts, "orbax_layouts": orbax_layouts,
            "pallas_layouts": pallas_layouts}


def check_every_layout_and_the_converted_checkpoint_give_the_single_device_tokens_and_logprobs(case):
    _, spec, results = case
    base = results["1x1"]
    assert len(results) == sum(map(len, spec[2:]))
    assert base["metrics"]["jaxpaged:num_preemptions_total"] > 0   # the small pool preempted
    assert base["metrics"]["jaxpaged:prefix_cache_hits_total"] > 0  # shared prefixes hit the cache
    for layout, result in results.items():
        assert len(result["tokens"]) == len(result["prompts"]) and all(result["tokens"]), layout
        for i, tokens, logprobs in zip(result["prompts"], result["tokens"], result["logprobs"]):
            # a shorter run (the Pallas layouts'): the first tokens of the full one's
            assert tokens == base["tokens"][i][:len(tokens)], layout
            np.testing.assert_allclose(np.array(logprobs), np.array(base["logprobs"][i][:len(tokens)]), atol=1e-4,
                                       err_msg=layout)


def check_each_device_holds_its_share_of_the_weights_and_the_kv_pool(case):
    _, _, results = case
    for layout, result in results.items():
        tp, dp = map(int, layout.split("-")[-1].split("x"))
        assert len(result["shards"]) == dp
        seen_devices = []
        for replica in result["shards"]:
            devices = replica["kv_pool"][0]
            assert len(devices) == tp
            seen_devices += devices
            for name, (holders, fraction) in replica.items():
                assert holders == devices, name   # every array of a replica lies on its own devices
                if name == "kv_pool" or name.split("/")[-1] in SHARDED:
                    assert fraction == pytest.approx(1 / tp), (layout, name)
                else:
                    assert fraction == 1.0, (layout, name)   # norms, row-parallel biases: replicated
        assert len(set(seen_devices)) == tp * dp   # replicas do not share devices


def check_data_parallel_spreads_requests_and_sums_metrics(case):
    _, _, results = case
    for layout, result in results.items():
        per_rank = result["per_rank"]
        if len(per_rank) == 1:
            continue
        prompt_tokens = [m["jaxpaged:prompt_tokens_total"] for m in per_rank]
        assert all(t > 0 for t in prompt_tokens), prompt_tokens   # both replicas got requests
        for name, value in result["metrics"].items():
            if name.endswith("_total"):
                assert value == sum(m[name] for m in per_rank), name
        assert result["metrics"]["jaxpaged:generation_tokens_total"] == \
            results["1x1"]["metrics"]["jaxpaged:generation_tokens_total"]



def layout_tests(*names: str) -> dict:
    """The tests of the cases `names` and their fixtures, for a test file's globals(): the cases run
    one after the other in one subprocess (one start-up of jax and torch for the file)."""
    @pytest.fixture(scope="module")
    def cases():
        return dict(zip(names, run_worker([case_spec(name) for name in names])))

    @pytest.fixture(params=names)
    def case(request, cases):
        return request.param, CASES[request.param], cases[request.param]

    data_parallel = [name for name in names if any(dp > 1 for _, dp in CASES[name][2])]

    @pytest.fixture(params=data_parallel)
    def data_parallel_case(request, cases):
        return request.param, CASES[request.param], cases[request.param]

    def test_every_layout_gives_the_single_device_tokens_and_logprobs(case):
        check_every_layout_and_the_converted_checkpoint_give_the_single_device_tokens_and_logprobs(case)

    def test_each_device_holds_its_share_of_the_weights_and_the_kv_pool(case):
        check_each_device_holds_its_share_of_the_weights_and_the_kv_pool(case)

    def test_data_parallel_spreads_requests_and_sums_metrics(data_parallel_case):
        check_data_parallel_spreads_requests_and_sums_metrics(data_parallel_case)

    tests = [cases, case, test_every_layout_gives_the_single_device_tokens_and_logprobs,
             test_each_device_holds_its_share_of_the_weights_and_the_kv_pool]
    if data_parallel:
        tests += [data_parallel_case, test_data_parallel_spreads_requests_and_sums_metrics]
    return {f.__name__: f for f in tests}
