"""Engine parts: a random model of a real shape, the engine end to end per backend, greedy agreement.

The model is Qwen2.5-0.5B's shape with random weights (no hub on the GPU machine), built and
saved by transformers in its own child process (torch stays out of the engine's processes).
Weights are drawn so that greedy decoding is not a coin toss: linear layers N(0, 1/fan_in)
keep activations O(1) through the layers, and a tied embedding of std 0.5 gives logits of
std ~15, far apart compared with bf16 rounding, yet not dominated by the current token.
"""

import os
import statistics
import time
from typing import Iterator

import numpy as np

from benchmarks.gpu_check.common import Context, Row, Sizes

MODEL_FOLDER = "model"
CHECKPOINT_DTYPE = "bfloat16"   # of the saved weights; the engine's default dtype ('auto') keeps it
_EMBED_STD = 0.5


def random_checkpoint(ctx: Context) -> Iterator[Row]:
    import torch
    import transformers

    start = time.perf_counter()
    config = transformers.Qwen2Config(**ctx.sizes.model)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, CHECKPOINT_DTYPE))   # half the memory and time of an fp32 model
    try:   # built on the GPU where there is one: its random init takes ~55 s of an H200 machine's CPU
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = transformers.Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, _EMBED_STD)
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:   # norm scales
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path = os.path.join(ctx.workdir, MODEL_FOLDER)
    model.save_pretrained(path, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    yield Row("checkpoint", f"Qwen2 random {config.num_hidden_layers} layers", "ok",
              {"params M": params / 1e6, "MB": size / 1e6, "s": time.perf_counter() - start}, note=path)


def checkpoint_model(ctx: Context, part: str, case: str) -> tuple[str, Row | None]:
    """The checkpoint part's folder, or an error row (part, case) when it made none."""
    path = os.path.join(ctx.workdir, MODEL_FOLDER)
    missing = not os.path.exists(os.path.join(path, "config.json"))
    return path, Row(part, case, "error", note=f"no model in {path}: see the checkpoint part") if missing else None


def engine_prompts(sizes: Sizes, vocab_size: int) -> tuple[list[dict], list[dict]]:
    """(timed prompts, warm-up prompts): same lengths, other tokens (no prefix-cache hits between them)."""
    rng = np.random.default_rng(0)
    lo, hi = sizes.engine_prompt_len
    prompts = [rng.integers(10, vocab_size - 10, int(rng.integers(lo, hi + 1))).tolist()
               for _ in range(sizes.engine_prompts)]
    warm = [[(t + 1) % vocab_size for t in p] for p in prompts]
    return [{"prompt_token_ids": p} for p in prompts], [{"prompt_token_ids": p} for p in warm]


def engine_run(ctx: Context, backend: str) -> Iterator[Row]:
    """LLM start-up, an untimed warm-up generate (it compiles the step shapes), then the timed batch."""
    import jax

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.kernels.backends import resolve_backend

    platform = jax.devices()[0].platform
    try:
        resolve_backend(backend, platform)
    except ValueError as exc:
        yield Row("engine", backend, "error" if platform == "gpu" else "skip", note=str(exc))
        return
    path, error = checkpoint_model(ctx, "engine", backend)
    if error is not None:
        yield error
        return
    sizes = ctx.sizes
    prompts, warm = engine_prompts(sizes, sizes.model["vocab_size"])
    per_seq = -(-(sizes.engine_prompt_len[1] + sizes.engine_max_tokens) // sizes.block_size)
    start = time.perf_counter()
    llm = LLM(path, dtype=CHECKPOINT_DTYPE, attention_backend=backend, block_size=sizes.block_size,
              max_num_seqs=sizes.engine_prompts, max_model_len=sizes.engine_max_model_len,
              max_num_batched_tokens=sizes.engine_batched_tokens,
              num_gpu_blocks_override=2 * sizes.engine_prompts * per_seq + 1, compile_on_startup=False,
              use_tqdm=False)
    startup = time.perf_counter() - start
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate(warm, SamplingParams(max_tokens=3, **greedy), use_tqdm=False)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=sizes.engine_max_tokens, **greedy), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(len(t) for t in tokens)
    yield Row("engine", backend, "ok",
              {"start-up s": startup, "warm-up s": warmup, "generate s": seconds, "out tok/s": generated / seconds,
               "seqs x tokens": f"{len(tokens)} x {sizes.engine_max_tokens}"},
              note="start-up without step compilation; warm-up = first generate (compiles)",
              data={"tokens": [t[:sizes.engine_agree_tokens] for t in tokens]})


def engine_agreement(ctx: Context) -> list[Row]:
    """Greedy tokens of each backend against the reference's (or the first backend that ran)."""
    runs = {r.case: r.data["tokens"] for r in ctx.rows_of("engine") if r.status == "ok" and "tokens" in r.data}
    if len(runs) < 2:
        return [Row("engine", "agreement", "skip", note=f"{len(runs)} backend(s) ran: nothing to compare")]
    base = "reference" if "reference" in runs else next(iter(runs))
    rows = []
    for name, tokens in runs.items():
        if name == base:
            continue
        pairs = list(zip(tokens, runs[base]))
        first = sum(a[:1] == b[:1] for a, b in pairs)
        whole = sum(a == b for a, b in pairs)
        prefix = statistics.mean(_common_prefix(a, b) for a, b in pairs)
        # bf16 on random weights: a near-tie may flip a late token; a wrong kernel flips most first tokens.
        ok = first >= 0.9 * len(pairs) and whole >= 0.5 * len(pairs)
        n = len(pairs[0][1]) if pairs else 0
        rows.append(Row("engine", f"agreement {name} vs {base}", "ok" if ok else "fail",
                        {"first token": f"{first}/{len(pairs)}", f"all {n}": f"{whole}/{len(pairs)}",
                         "mean common prefix": prefix}))
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def speculative_step_cost(ctx: Context) -> Iterator[Row]:
    """Speculative decoding's premise on the GPU: a step verifying k drafts per sequence costs little more than a
    decode step. The engine without and with speculative_config (k = 4, a proposer that always drafts
    k tokens, so every decode step verifies), each compiling its steps at start-up (the default: compiled
    lazily, the timing would include the compilations of shapes a warm-up had not taken: 360 ms a
    verifying step on an H200); ms per step after an untimed warm-up; compilations while timed must be 0."""
    from jaxpaged import LLM, SamplingParams
    from benchmarks.gpu_check.step import compilations
    from jaxpaged.benchmarks.throughput import StepClock

    path, error = checkpoint_model(ctx, "spec", "verify vs decode")
    if error is not None:
        yield error
        return
    sizes = ctx.sizes
    prompts, warm = engine_prompts(sizes, sizes.model["vocab_size"])
    per_seq = -(-(sizes.engine_prompt_len[1] + sizes.engine_max_tokens + 8) // sizes.block_size)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, detokenize=False, max_tokens=sizes.engine_max_tokens)
    ms = {}
    for name, spec in (("decode", None), ("verify k=4", {"method": "ngram", "num_speculative_tokens": 4})):
        llm = LLM(path, dtype=CHECKPOINT_DTYPE, block_size=sizes.block_size, max_num_seqs=sizes.engine_prompts,
                  max_model_len=sizes.engine_max_model_len, max_num_batched_tokens=sizes.engine_batched_tokens,
                  num_gpu_blocks_override=2 * sizes.engine_prompts * per_seq + 1, use_tqdm=False,
                  speculative_config=spec)
        if spec is not None:
            speculator = llm.llm_engine.speculator
            speculator.proposer = lambda request, k: [int(request.all_token_ids[-1])] * k
        llm.generate(warm, greedy, use_tqdm=False)
        clock = StepClock(llm.llm_engine.runner)
        with compilations() as compiled:
            start = time.perf_counter()
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            seconds = time.perf_counter() - start
        ms[name] = 1e3 * seconds / max(clock.steps, 1)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        yield Row("spec", name, "fail" if compiled else "ok",
                  {"ms/step": ms[name], "steps": clock.steps, "out tok/s": tokens / seconds, "seqs": len(prompts),
                   "XLA compiles": len(compiled)},
                  note=f"compiled while timed: {', '.join(sorted({n for n, _ in compiled}))}" if compiled else "")
        del llm
    yield Row("spec", "verify / decode step", "ok", {"ratio": ms["verify k=4"] / ms["decode"]},
              note="5 tokens per sequence per verifying step; drafts repeat the last token (mostly rejected)")


def tier_reload(ctx: Context) -> Iterator[Row]:
    """The host tier (kv_offloading_size): a history of tier_history tokens computed, pushed out of a
    small device pool by other prompts, then resent with a few more tokens: its TTFT reloaded from
    host memory against recomputed (an engine without the tier, same steps), and the host-to-device
    rate of the load (the tier's blocks over the time of the step that loads them)."""
    from jaxpaged import LLM, SamplingParams

    path, error = checkpoint_model(ctx, "tier", "reload")
    if error is not None:
        yield error
        return
    sizes = ctx.sizes
    history_len, bs = sizes.tier_history, sizes.block_size
    rng = np.random.default_rng(3)
    vocab = sizes.model["vocab_size"]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    blocks = 2 * (history_len // bs) + 8          # two histories' worth: other prompts cycle it whole
    prompt = lambda: rng.integers(10, vocab - 10, history_len).tolist()
    ttft = {}
    for name, extra in (("reloaded", dict(kv_offloading_size=1.0)), ("recomputed", {})):
        llm = LLM(path, dtype=CHECKPOINT_DTYPE, block_size=bs, max_model_len=history_len + 2 * bs,
                  num_gpu_blocks_override=blocks, compile_on_startup=False, use_tqdm=False, **extra)

        def cycle():
            """A history computed, pushed out by other prompts, then resent with a block more: seconds."""
            history = prompt()
            llm.generate([{"prompt_token_ids": history}], one, use_tqdm=False)
            llm.generate([{"prompt_token_ids": prompt()} for _ in range(blocks // (history_len // bs) + 1)], one,
                         use_tqdm=False)
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": history + [7] * bs}], one, use_tqdm=False)
            return time.perf_counter() - start
        cycle()                                  # compiles every shape and block move it takes
        hits_before = llm.get_metrics()["jaxpaged:external_prefix_cache_hits_total"]
        ttft[name] = cycle()
        hits = llm.get_metrics()["jaxpaged:external_prefix_cache_hits_total"] - hits_before
        if name == "reloaded":
            block_bytes = llm.llm_engine.runner.block_bytes()
            yield Row("tier", f"reload {history_len} tokens", "ok" if hits >= history_len - bs else "fail",
                      {"TTFT ms": ttft[name] * 1e3, "host hit tokens": hits,
                       "H2D GB/s (incl. step)": hits // bs * block_bytes / ttft[name] / 1e9})
        llm = None   # let the engine's memory go before the next
    yield Row("tier", f"recompute {history_len} tokens", "ok",
              {"TTFT ms": ttft["recomputed"] * 1e3, "reload / recompute": ttft["reloaded"] / ttft["recomputed"]})
