"""`jaxpaged bench multiturn`: multi-turn chat that the device's KV pool cannot hold between turns,
with the host-memory tier (kv_offloading_size) against without it, in the same run.

    jaxpaged bench multiturn [--conversations 12] [--turns 4] [--system-len 160] [--user-len 48]
                             [--answer-len 24] [--blocks 96] [--tier-gib 1] [--model FOLDER] [--json FILE]

Each conversation has a system prompt of its own, then user turns; every turn resends the whole
history (system prompt, earlier turns and answers) as the next prompt, as a chat client does. All
conversations' turn t are served together, then all turns t + 1. The device pool is given --blocks
blocks (a pool that holds a few conversations, not all); one engine runs with the tier and one
without, on the same workload, and a third with a pool large enough for every conversation (the
ceiling the tier should come near). Per engine it prints TTFT p50 / p99 (a request's first token,
from when its turn was submitted) and the prompt tokens it computed (prompt tokens less those found
cached, on the device or in host memory), and the tier's hits. The default model is the built-in
SmolLM2-135M (default engine arguments otherwise); greedy, so the engines' answers must agree.
"""

import argparse
import json
import statistics
import time

import numpy as np


def conversations(num: int, turns: int, system_len: int, user_len: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(3, vocab, system_len).tolist()] + [rng.integers(3, vocab, user_len).tolist()
                                                             for _ in range(turns)] for _ in range(num)]


def serve(engine, convs, answer_len: int) -> dict:
    """All conversations turn by turn on one engine: TTFTs, prompt tokens computed, answers."""
    from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    histories = [c[0] for c in convs]
    ttfts, answers, cached, prompt_tokens = [], [], 0, 0
    for turn in range(1, len(convs[0])):
        submitted, first, tokens = {}, {}, {}
        for i, conv in enumerate(convs):
            rid = f"c{i}-t{turn}"
            prompt = histories[i] + conv[turn]
            prompt_tokens += len(prompt)
            submitted[rid] = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            tokens[rid] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = out.outputs[0].token_ids
                if new and out.request_id not in first:
                    first[out.request_id] = time.perf_counter()
                tokens[out.request_id] += list(new)
                if out.finished:
                    cached += out.num_cached_tokens or 0
        for i, conv in enumerate(convs):
            rid = f"c{i}-t{turn}"
            ttfts.append(first[rid] - submitted[rid])
            histories[i] = histories[i] + conv[turn] + tokens[rid]
            answers.append(tokens[rid])
    metrics = engine.get_metrics()
    return {"ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * float(np.percentile(ttfts, 99)),
            "prompt_tokens": prompt_tokens, "prompt_tokens_computed": prompt_tokens - cached,
            "host_hit_tokens": metrics.get("jaxpaged:external_prefix_cache_hits_total", 0),
            "preemptions": metrics.get("jaxpaged:num_preemptions_total", 0), "answers": answers}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxpaged bench multiturn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the built-in model)")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=160)
    parser.add_argument("--user-len", type=int, default=48)
    parser.add_argument("--answer-len", type=int, default=24)
    parser.add_argument("--blocks", type=int, default=96, help="KV blocks of the small device pool")
    parser.add_argument("--tier-gib", type=float, default=1.0, help="kv_offloading_size of the tier run")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engines' (default: vLLM's 256; fewer compile fewer step shapes at start-up)")
    parser.add_argument("--json", default=None, help="also write the results here")
    ns = parser.parse_args(argv)

    from jaxpaged.engine.arg_utils import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine

    longest = ns.system_len + ns.turns * (ns.user_len + ns.answer_len)
    max_model_len = -(-longest // 16) * 16 + 16
    big_pool = ns.conversations * (max_model_len // 16) + 16
    runs = {"tier": dict(num_gpu_blocks_override=ns.blocks, kv_offloading_size=ns.tier_gib),
            "no tier": dict(num_gpu_blocks_override=ns.blocks),
            "pool for all": dict(num_gpu_blocks_override=big_pool)}
    results = {}
    convs = None
    for name, kwargs in runs.items():
        start = time.perf_counter()
        if ns.max_num_seqs:
            kwargs["max_num_seqs"] = ns.max_num_seqs
        engine = LLMEngine(EngineArgs(model=ns.model, max_model_len=max_model_len, **kwargs), use_tqdm=False)
        convs = convs or conversations(ns.conversations, ns.turns, ns.system_len, ns.user_len,
                                       engine.model_config.vocab_size)
        results[name] = serve(engine, convs, ns.answer_len)
        r = results[name]
        print(f"{name:>12}: TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms   prompt tokens "
              f"computed {r['prompt_tokens_computed']:6d} of {r['prompt_tokens']}   host hits {r['host_hit_tokens']:6d}"
              f"   preemptions {r['preemptions']}   ({time.perf_counter() - start:.0f} s with start-up)", flush=True)
        del engine
    tier, none, ceiling = (results[k] for k in runs)
    print(f"tier: prompt tokens computed {tier['prompt_tokens_computed'] / ceiling['prompt_tokens_computed']:.2f}x "
          f"the pool for all's (goal <= 1.15x), {tier['prompt_tokens_computed'] / none['prompt_tokens_computed']:.2f}x "
          f"without the tier; TTFT p50 {tier['ttft_p50_ms'] / none['ttft_p50_ms']:.2f}x, "
          f"p99 {tier['ttft_p99_ms'] / none['ttft_p99_ms']:.2f}x without the tier")
    agree = tier["answers"] == none["answers"] == ceiling["answers"]
    print(f"greedy answers {'identical' if agree else 'DIFFER'} across the three engines")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({k: {m: v for m, v in r.items() if m != "answers"} for k, r in results.items()}, f, indent=1)
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
