"""One host of a two-host engine on this machine (a localhost coordinator, one CPU device each,
JAX's gloo CPU collectives): tensor parallelism 2 spans both processes.

    python -m tests.parallel.multihost_worker RANK PORT CHECKPOINT

Rank 0 generates (greedy, with logprobs; with structured outputs; the first prompts again, from the host
tier), then runs two requests step by step and aborts one
midway; it prints RESULT {tokens, logprobs, kept, steps}. Rank 1 follows and prints
RESULT {steps}: the number of steps it ran, which must equal rank 0's.
"""

import json
import sys


# swap preemption (block moves), the host tier's stores and loads, and penalties, min_tokens, logit_bias and
# n > 1 (slot updates, forks): every kind of device operation a follower replays
ENGINE = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=24, block_size=8,
              preemption_mode="swap", swap_space=64 * 3072 / 2**30,   # 64 host blocks of the tiny model
              kv_offloading_size=256 * 3072 / 2**30,   # 64 blocks (12 KiB each)
              compile_on_startup=False)   # each step compiles when first met, on both hosts alike


def extra_params():
    from jaxpaged import SamplingParams
    return SamplingParams(n=2, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4,
                          logit_bias={5: 2.0}, max_tokens=16, ignore_eos=True)


def constrained_params():
    """Structured outputs: the bitmask each step's sampler applies reaches the follower too."""
    from jaxpaged import SamplingParams, StructuredOutputsParams
    return SamplingParams(n=2, temperature=0.0, max_tokens=16,
                          structured_outputs=StructuredOutputsParams(regex="(ab|ba|cd|dc){5}"))


def main(rank: int, port: int, path: str) -> dict:
    from jaxpaged import LLM
    from tests.parallel.worker import prompts_and_params

    llm = LLM(path, tensor_parallel_size=2, use_tqdm=False, distributed_coordinator=f"localhost:{port}",
              num_nodes=2, node_rank=rank, **ENGINE)
    runner = llm.llm_engine.runner
    if llm.is_follower:   # LLM(...) returned: rank 0 shut down
        return {"steps": runner.steps_run}
    prompts, params = prompts_and_params()
    outs = llm.generate(prompts, params, use_tqdm=False)
    extra = llm.generate(prompts[:4], extra_params(), use_tqdm=False)   # persistent-batch updates, forks
    constrained = llm.generate(prompts[:3], [constrained_params(), params, constrained_params()], use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)   # prefixes evicted since: loaded from the host tier
    engine = llm.llm_engine
    engine.add_request("kept", prompts[0], params)
    engine.add_request("aborted", prompts[1], params)
    kept = None
    for i in range(200):
        for out in engine.step():
            if out.request_id == "kept" and out.finished:
                kept = out.outputs[0].token_ids
        if i == 3:
            engine.abort_request("aborted")
        if not engine.has_unfinished_requests():
            break
    result = {"tokens": [o.outputs[0].token_ids for o in outs],
              "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                           for o in outs],
              "kept": kept, "steps": runner.steps_run, "extra": [[c.token_ids for c in o.outputs] for o in extra],
              "constrained": [[c.token_ids for c in o.outputs] for o in constrained],
              "swapped": llm.get_metrics()["jaxpaged:swapped_out_blocks_total"],
              "again": [o.outputs[0].token_ids for o in again],
              "tier_hits": llm.get_metrics()["jaxpaged:external_prefix_cache_hits_total"]}
    llm.shutdown()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])), flush=True)
