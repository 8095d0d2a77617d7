"""Runs in a subprocess with 8 CPU devices (XLA_FLAGS set before jax is imported): generates
with several parallel layouts on one tiny checkpoint and prints the results as JSON.

    python -m tests.parallel.worker '{"arch": "llama", "overrides": {...}, "layouts": [[1, 1], [2, 1]]}'

or a JSON list of such specs, run one after the other in this process (a list of results).
"""

import json
import os
import sys


def shard_fractions(llm) -> dict:
    """For each replica: array name -> (devices holding it, the largest fraction of it any device holds)."""
    import jax
    from flax import nnx

    out = []
    for engine in llm.llm_engine.replicas():
        runner = engine.runner
        arrays = {}
        for path, v in nnx.to_flat_state(runner.state):   # a QuantizedWeight: one entry per array, "wqkv/values"
            for sub, leaf in jax.tree_util.tree_leaves_with_path(v.get_value() if isinstance(v, nnx.Variable) else v):
                arrays["/".join(map(str, path)) + "".join(f"/{k.name}" for k in sub)] = leaf
        arrays["kv_pool"] = runner.kv_pool
        info = {}
        for name, a in arrays.items():
            fractions = [s.data.size / a.size for s in a.addressable_shards]
            info[name] = [sorted({str(s.device) for s in a.addressable_shards}), max(fractions)]
        out.append(info)
    return out


# The Pallas layouts' share of the workload (the kernel runs in interpret mode on CPU: the whole workload took
# 141 s against 11 s for another layout): two prompts sharing a prefix and the chunked one, their first tokens.
SHORT_PROMPTS, SHORT_MAX_TOKENS = (0, 1, 6), 5


def prompts_and_params(short: bool = False):
    """Shared prefixes (prefix caching), a prompt longer than the step budget (chunked prefill),
    and, with the engines' 24 blocks, more sequences than the pool holds at once (preemption).
    `short`: SHORT_PROMPTS only, SHORT_MAX_TOKENS each (greedy: the first tokens of the full run's)."""
    from jaxpaged import SamplingParams

    base = list(range(3, 40))
    prompts = [{"prompt_token_ids": base + [50 + i] * (i + 1)} for i in range(6)]
    prompts.append({"prompt_token_ids": list(range(100, 190))})
    if short:
        return [prompts[i] for i in SHORT_PROMPTS], SamplingParams(temperature=0.0, max_tokens=SHORT_MAX_TOKENS,
                                                                   logprobs=2, ignore_eos=True)
    return prompts, SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)


def allow_concurrent_gpu_interpret():
    """jax 0.11.2's Mosaic GPU interpret mode checks, as each device's kernel ends, that no barrier of
    ANY device is still allocated, before the devices meet at its clean-up barrier: under shard_map a
    device that finishes first sees another's live barrier and fails. The per-kernel clean-up still
    frees every barrier; only the racy check is skipped (test processes only)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    gpu_callbacks.call_assert_no_barriers_allocated = lambda token: token


def main(spec: dict) -> dict:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxpaged import LLM
    from tests.tiny_models import scratch_folder, tiny_checkpoint

    path = tiny_checkpoint(spec["arch"], **spec.get("overrides", {}))
    runs = [("", path, tp, dp) for tp, dp in spec["layouts"]]
    runs += [("pallas-", path, tp, dp) for tp, dp in spec.get("pallas_layouts", [])]
    runs += [("plain-", path, tp, dp) for tp, dp in spec.get("plain_layouts", [])]   # without spec["engine"]
    if spec.get("orbax_layouts"):   # `jaxpaged convert`'s folder, restored into each layout
        from jaxpaged.models.loader import convert_checkpoint
        converted = convert_checkpoint(path, os.path.join(scratch_folder("converted-"), "converted"), "float32")
        runs += [("orbax-", converted, tp, dp) for tp, dp in spec["orbax_layouts"]]
    # steps compile as the workload meets them: start-up compiles every bucket and sampler kind,
    # which these checks (the same tokens in every layout) do not need
    lazy = {"compile_on_startup": False}
    if spec.get("pallas_layouts"):
        allow_concurrent_gpu_interpret()
    results = {}
    for prefix, source, tp, dp in runs:
        backend = {"attention_backend": "pallas"} if prefix == "pallas-" else {}   # interpret mode on CPU
        extra = lazy if prefix == "plain-" else {**lazy, **spec.get("engine", {})}
        llm = LLM(source, dtype="float32", **backend, tensor_parallel_size=tp, data_parallel_size=dp, max_num_batched_tokens=32,
                  max_num_seqs=4, num_gpu_blocks_override=spec.get("blocks", 24), block_size=8, use_tqdm=False,
                  **extra)
        short = prefix == "pallas-"
        prompts, params = prompts_and_params(short)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[f"{prefix}{tp}x{dp}"] = {
            "prompts": list(SHORT_PROMPTS if short else range(len(prompts))),   # which of the full run's
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs],
            "shards": shard_fractions(llm),
            "metrics": llm.get_metrics(),
            "per_rank": llm.llm_engine.get_metrics_per_rank(),
        }
        del llm
    return results


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    # a list of specs runs in this one process (one start-up, one checkpoint per model), a list of results
    print("RESULT " + json.dumps([main(s) for s in spec] if isinstance(spec, list) else main(spec)))
