"""The same-run peer: output tokens/s of the engine against transformers' own continuous batching
(`generate_batch`, its paged attention and CUDA graphs), on the same weights (the checkpoint part's
random Qwen2.5-0.5B shape, bf16) and the same workload: `peer_requests` prompts whose lengths follow
ShareGPT's shape (lognormal around a median, clipped), each generating `peer_new_tokens` greedy tokens
(EOS ignored by both, so both produce the same number of tokens). Each engine runs in a child of its
own (torch stays out of the engine's process); the ratio is `peer_ratio`'s row (the goal: >= 5x).
"""

import time
from typing import Iterator

import numpy as np

from benchmarks.gpu_check.common import Context, Row, Sizes
from benchmarks.gpu_check.engine import checkpoint_model


def peer_workload(sizes: Sizes, vocab_size: int) -> list[list[int]]:
    """The prompts, the same in both children: lengths lognormal (sigma 0.8, ShareGPT-like) around the median."""
    rng = np.random.default_rng(22)
    median, shortest, longest = sizes.peer_prompt_len
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, sizes.peer_requests).astype(int), shortest, longest)
    return [rng.integers(10, vocab_size - 10, int(n)).tolist() for n in lengths]


def _row(case: str, seconds: float, tokens: int, sizes: Sizes, note: str) -> Row:
    expected = sizes.peer_requests * sizes.peer_new_tokens
    return Row("peer", case, "ok" if tokens == expected else "fail",
               {"s": seconds, "out tok/s": tokens / seconds, "requests": sizes.peer_requests, "tokens out": tokens},
               note=note if tokens == expected else f"{tokens} tokens out, {expected} asked; {note}")


def transformers_run(ctx: Context) -> Iterator[Row]:
    import torch
    import transformers

    sizes = ctx.sizes
    path, error = checkpoint_model(ctx, "peer", "transformers generate_batch")
    if error is not None:
        yield error
        return
    cuda = torch.cuda.is_available()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if cuda else torch.float32)
    model = model.to("cuda" if cuda else "cpu").eval()
    prompts = peer_workload(sizes, sizes.model["vocab_size"])
    config = transformers.GenerationConfig(max_new_tokens=sizes.peer_new_tokens, min_new_tokens=sizes.peer_new_tokens,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)
    batching = (transformers.ContinuousBatchingConfig(**sizes.peer_transformers_args)
                if sizes.peer_transformers_args else None)   # None: transformers' defaults (older versions lack the class)
    with torch.no_grad():
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching)
        seconds = time.perf_counter() - start
    tokens = sum(len(out.generated_tokens) for out in outputs.values())
    yield _row("transformers generate_batch", seconds, tokens, sizes,
               f"transformers {transformers.__version__}, torch {torch.__version__}, attention "
               f"{model.config._attn_implementation}, {'cuda bf16' if cuda else 'cpu fp32'}; its default warm-up "
               f"(CUDA graphs captured) inside the time")


def engine_run(ctx: Context) -> Iterator[Row]:
    from jaxpaged import LLM, SamplingParams

    sizes = ctx.sizes
    path, error = checkpoint_model(ctx, "peer", "jaxpaged")
    if error is not None:
        yield error
        return
    start = time.perf_counter()
    llm = LLM(path, **sizes.peer_engine_args)
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in peer_workload(sizes, sizes.model["vocab_size"])]
    params = SamplingParams(temperature=0.0, max_tokens=sizes.peer_new_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    given = ", ".join(f"{k} {v}" for k, v in sizes.peer_engine_args.items()) or "default arguments"
    yield _row("jaxpaged", seconds, tokens, sizes, f"LLM(model, {given}), start-up {startup:.1f} s before the time")


def peer_ratio(ctx: Context) -> list[Row]:
    runs = {r.case: r.metrics for r in ctx.rows_of("peer") if r.status == "ok"}
    ours, theirs = runs.get("jaxpaged"), runs.get("transformers generate_batch")
    if not ours or not theirs:
        return [Row("peer", "ratio", "skip", note="both peer runs are needed")]
    ratio = ours["out tok/s"] / theirs["out tok/s"]
    return [Row("peer", "ratio", "ok", {"jaxpaged / transformers": ratio, "goal": 5.0, "meets": ratio >= 5.0},
                note="output tokens/s, same weights and workload, same GPU, same run")]
