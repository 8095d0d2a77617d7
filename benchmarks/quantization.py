"""Quantization on the built-in model: accuracy, memory and decode speed per mode, in one run.

    python -m benchmarks.quantization [--skip-speed] [--text PATH] [--modes fp32,int8,...]

Modes: fp32 (the GGUF de-quantized, `quantization=None`), gguf (its Q4_1 / Q8_0 blocks kept: the
default), int8 / fp8 / int4 (quantized at load from the fp32 weights, read from a `jaxpaged convert`
folder made once under the temp dir), and the fp32 weights with an fp8 KV cache (scales 1.0, and
calibrated on the first prompts with calculate_kv_scales).

- perplexity on a fixed English text (tests/data/english_text.txt, ~2,600 tokens) in windows of
  1,024 tokens, from the engine's prompt logprobs;
- top-1 agreement with the fp32 engine over its 512-token greedy continuation of the text's start
  (teacher-forced: each position asks whether the mode's top token is fp32's);
- the chat answer to "What is the capital of France?";
- weight bytes on the device (the live arrays) and KV tokens in a 64 MiB kv_cache_memory_bytes;
- decode throughput: 32 requests of 64 prompt tokens and 128 output tokens, default engine
  arguments but the mode (start-up not timed).
"""

import argparse
import dataclasses
import gc
import math
import os
import time

import numpy as np

from jaxpaged.benchmarks import derived_folder

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "tests", "data", "english_text.txt")
WINDOW = 1024
AGREEMENT_TOKENS = 512
KV_BUDGET = 64 << 20
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    source: str                   # "gguf": the built-in file; "fp32": the converted fp32 folder
    engine: dict                  # engine arguments


MODES = {
    "fp32": Mode("fp32", "gguf", dict(quantization=None)),
    "gguf": Mode("gguf (Q4_1 + Q8_0 kept)", "gguf", dict(quantization="gguf")),
    "int8": Mode("int8", "fp32", dict(quantization="int8")),
    "fp8": Mode("fp8", "fp32", dict(quantization="fp8")),
    "int4": Mode("int4 (groups of 32)", "fp32", dict(quantization="int4")),
    "fp8-kv": Mode("fp32 + fp8 KV", "gguf", dict(quantization=None, kv_cache_dtype="fp8")),
    "fp8-kv-calibrated": Mode("fp32 + fp8 KV, calculate_kv_scales", "gguf",
                              dict(quantization=None, kv_cache_dtype="fp8", calculate_kv_scales=True)),
}


def fp32_folder() -> str:
    """The built-in model as an fp32 converted folder (made once, reused)."""
    from jaxpaged.models.builtin import builtin_model_path
    from jaxpaged.models.loader import convert_checkpoint

    path = builtin_model_path()
    out = derived_folder("jaxpaged-bench-quantization", path)
    if not os.path.isdir(out):
        staging = out + f".partial-{os.getpid()}"
        convert_checkpoint(path, staging, "float32")
        os.rename(staging, out)
    return out


def make_llm(mode: Mode, **engine):
    from jaxpaged import LLM
    return LLM(None if mode.source == "gguf" else fp32_folder(), dtype="float32", use_tqdm=False,
               **{**mode.engine, **engine})


def text_tokens(llm, path: str = TEXT, limit: int | None = None) -> list[int]:
    with open(path) as f:
        tokens = llm.get_tokenizer().encode(f.read())
    return tokens[:limit] if limit else tokens


def prompt_logprobs(llm, tokens: list[int], top: int = 0):
    """Per window of WINDOW tokens: the logprob of each token after the first, and (top=1) each
    position's top token."""
    from jaxpaged import SamplingParams

    windows = [tokens[i:i + WINDOW] for i in range(0, len(tokens), WINDOW) if len(tokens[i:i + WINDOW]) > 1]
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top), use_tqdm=False)
    logprobs, tops = [], []
    for window, out in zip(windows, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            logprobs.append(entry[token].logprob)
            tops.append(next((t for t, lp in entry.items() if lp.rank == 1), token))
    return np.array(logprobs), tops


def perplexity(llm, tokens: list[int]) -> float:
    return float(math.exp(-prompt_logprobs(llm, tokens)[0].mean()))


def greedy_continuation(llm, tokens: list[int], n: int = AGREEMENT_TOKENS) -> list[int]:
    from jaxpaged import SamplingParams
    out = llm.generate({"prompt_token_ids": tokens}, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def top1_agreement(llm, prefix: list[int], reference: list[int]) -> float:
    """Share of the reference continuation's positions where this engine's top token is the reference's."""
    _, tops = prompt_logprobs(llm, prefix + reference, top=1)
    predicted = tops[len(prefix) - 1:]
    return float(np.mean([p == r for p, r in zip(predicted, reference)]))


def chat_answer(llm) -> str:
    from jaxpaged import SamplingParams
    return llm.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0].text


def weight_bytes(llm) -> int:
    """Bytes of the model's live arrays on the device (quantized values, scales and offsets; the
    fp8 KV scales excluded)."""
    import jax
    from flax import nnx
    runner = llm.llm_engine.runner
    return sum(leaf.nbytes for path, v in nnx.to_flat_state(runner.state) if path[0] != "kv_scales"
               for leaf in jax.tree.leaves(v.get_value() if isinstance(v, nnx.Variable) else v))


def kv_tokens(mode: Mode) -> int:
    llm = make_llm(mode, kv_cache_memory_bytes=KV_BUDGET, compile_on_startup=False, max_model_len=512)
    return (llm.llm_engine.num_blocks - 1) * llm.llm_engine.args.block_size


def decode_throughput(mode: Mode) -> tuple[float, float]:
    """(output tokens/s, start-up s): 32 requests x (64 prompt, 128 output) tokens, default engine arguments."""
    from jaxpaged import SamplingParams
    start = time.perf_counter()
    llm = make_llm(mode)
    startup = time.perf_counter() - start
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 49000, 64).tolist()} for _ in range(32)]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    del llm
    gc.collect()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, startup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--skip-speed", action="store_true")
    ns = parser.parse_args(argv)
    names = ns.modes.split(",")
    base = make_llm(MODES["fp32"], compile_on_startup=False)
    tokens = text_tokens(base, ns.text)
    prefix = tokens[:64]
    reference = greedy_continuation(base, prefix)
    del base
    gc.collect()   # each engine holds its KV pool (1 GiB on CPU) until collected
    rows = []
    for name in names:
        mode = MODES[name]
        llm = make_llm(mode, compile_on_startup=False)
        row = dict(mode=mode.name, ppl=perplexity(llm, tokens), agree=top1_agreement(llm, prefix, reference),
                   paris="Paris" in chat_answer(llm), weights=weight_bytes(llm), kv=kv_tokens(mode))
        del llm
        gc.collect()
        if not ns.skip_speed:
            row["tok_s"], row["startup"] = decode_throughput(mode)
        rows.append(row)
        print(row, flush=True)
    fp32 = next((r for r in rows if r["mode"] == MODES["fp32"].name), rows[0])
    print(f"\ntext: {len(tokens)} tokens ({os.path.basename(ns.text)}), windows of {WINDOW}; agreement over "
          f"{len(reference)} greedy fp32 tokens; KV tokens in {KV_BUDGET >> 20} MiB")
    head = f"{'mode':36s} {'ppl':>7s} {'vs fp32':>8s} {'top-1':>6s} {'Paris':>5s} {'weights MB':>10s} {'KV tok':>7s}"
    print(head + ("" if ns.skip_speed else f" {'decode tok/s':>12s} {'start-up s':>10s}"))
    for r in rows:
        line = (f"{r['mode']:36s} {r['ppl']:7.3f} {100 * (r['ppl'] / fp32['ppl'] - 1):+7.2f}% {100 * r['agree']:5.1f}% "
                f"{'yes' if r['paris'] else 'NO':>5s} {r['weights'] / 1e6:10.1f} {r['kv']:7d}")
        if not ns.skip_speed:
            line += f" {r['tok_s']:12.1f} {r['startup']:10.1f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
