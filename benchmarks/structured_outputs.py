"""What structured outputs cost: the throughput workload with half its requests JSON-schema
constrained, against the same workload unconstrained, in one engine (same run).

    python -m benchmarks.structured_outputs [--num-requests 32] [--repeats 2]

The 32 ShareGPT-shaped requests of `jaxpaged.benchmarks.throughput` (greedy, default engine
arguments, no warm-up on the workload). In the constrained run every other request must
produce a JSON array of integers sized to its token budget (capped at the workload's
max_tokens). The free run gives each request exactly the number of tokens its constrained
run produced (`ignore_eos`), so both runs compute the same batches step for step and the
difference is what the constraint costs: matchers, masks and their transfer. The runs
alternate (constrained, free, constrained, ...) so drift on a noisy machine shows; wall time
is the figure (mean over the repeats).
"""

import argparse
import json
import time

from jaxpaged.benchmarks.throughput import StepClock, make_workload


def schema_for(max_tokens: int) -> dict:
    items = max(1, max_tokens // 6)   # digits are single tokens: "123, " is up to five
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": items, "maxItems": items}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of (free, constrained) runs")
    ns = parser.parse_args(argv)

    from jaxpaged import LLM, SamplingParams, StructuredOutputsParams

    start = time.perf_counter()
    llm = LLM(use_tqdm=False)
    print(f"start-up {time.perf_counter() - start:.1f} s (not timed below)")
    work = make_workload(ns.num_requests, llm.llm_engine.model_config.vocab_size)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    constrained = [SamplingParams(temperature=0.0, max_tokens=n,
                                  structured_outputs=StructuredOutputsParams(json=schema_for(n)) if i % 2 else None,
                                  ignore_eos=not i % 2) for i, (_, n) in enumerate(work)]
    rows, free = [], None
    for _ in range(ns.repeats):
        for name in ("half JSON-schema constrained", "none constrained"):
            params = constrained if free is None or name.startswith("half") else free
            clock = StepClock(llm.llm_engine.runner)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            llm.llm_engine.runner.dispatch, llm.llm_engine.runner.fetch = clock.originals
            if free is None:   # the same lengths, unconstrained
                free = [SamplingParams(temperature=0.0, max_tokens=len(o.outputs[0].token_ids), ignore_eos=True)
                        for o in outputs]
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            valid = sum(isinstance(_parse(o.outputs[0].text), list) for o, p in zip(outputs, params)
                        if p.structured_outputs is not None)
            rows.append((name, elapsed, tokens, clock.summary(elapsed), valid))
    print(f"workload: {len(work)} requests, greedy, default engine arguments")
    print(f"{'run':30s} {'time s':>7s} {'out tokens':>10s} {'out tok/s':>9s}  steps")
    for name, secs, tokens, steps, valid in rows:
        note = f"; {valid} constrained outputs parse as JSON arrays" if "constrained" in name and "half" in name else ""
        print(f"{name:30s} {secs:7.1f} {tokens:10d} {tokens / secs:9.1f}  {steps}{note}")
    free_time = sum(secs for name, secs, *_ in rows if name.startswith("none")) / ns.repeats
    cons_time = sum(secs for name, secs, *_ in rows if name.startswith("half")) / ns.repeats
    print(f"constrained / free wall time: {cons_time / free_time:.3f} (cost {100 * (cons_time / free_time - 1):.1f}%)")
    return 0


def _parse(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
