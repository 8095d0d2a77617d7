"""One host of a two-host engine on this machine (a localhost coordinator, one CPU device each,
JAX's gloo CPU collectives): tensor parallelism 2 spans both processes.

    python -m tests.parallel.multihost_worker RANK PORT CHECKPOINT

Rank 0 generates (greedy, with logprobs), then runs two requests step by step and aborts one
midway; it prints RESULT {tokens, logprobs, kept, steps}. Rank 1 follows and prints
RESULT {steps}: the number of steps it ran, which must equal rank 0's.
"""

import json
import sys


def main(rank: int, port: int, path: str) -> dict:
    from jaxpaged import LLM
    from tests.parallel.worker import prompts_and_params

    llm = LLM(path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32, max_num_seqs=4,
              num_gpu_blocks_override=24, block_size=8, use_tqdm=False, distributed_coordinator=f"localhost:{port}",
              num_nodes=2, node_rank=rank)
    runner = llm.llm_engine.runner
    if llm.is_follower:   # LLM(...) returned: rank 0 shut down
        return {"steps": runner.steps_run}
    prompts, params = prompts_and_params()
    outs = llm.generate(prompts, params, use_tqdm=False)
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
              "kept": kept, "steps": runner.steps_run}
    llm.shutdown()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])), flush=True)
