"""`jaxpaged bench latency`: what one decode step costs the host, at two batch sizes.

    jaxpaged bench latency [--seqs 32,256] [--new-tokens 48] [--prompt-len 16] [--model FOLDER] [--repeat 3]

N sequences decode together (greedy, ignore_eos, outputs at the end as `LLM.generate` asks;
`--output-kind delta` as a server's streams) through `LLMEngine.step()`, default engine arguments. A
step counts when all N sequences decode in it and the step it fetches decoded all N too (the steady
state). Per size it prints the median wall time of those steps, the host's share (the wall time less
the time `fetch` waited for the device) and each host phase (wall times of the engine's own calls,
named in PHASES; those an engine lacks are left out). The default model is built here, random: one
layer, 64 wide, a vocabulary of 512, so that the host's work is most of a step; on a CPU the
"device" is the same two cores, so the wall time there is bounded by the step's compute as well.
On a GPU, pass a real model folder to see the same split at its size.

It prints one line per batch size and the ratio of the largest to the smallest: the host's work
per step should not grow with the batch (the goal: at 256 sequences <= 1.6x its share at 32).
"""

import argparse
import contextlib
import importlib
import json
import os
import statistics
import tempfile
import time
import types

import numpy as np

# (label, where the engine keeps the object, method): a phase is the wall time of that call inside
# LLMEngine.step(); nested ones are not subtracted from their callers.
PHASES = (
    ("schedule", "scheduler", "schedule"),
    ("dispatch", "runner", "dispatch"),
    ("inputs", "runner", "prepare_inputs"),
    ("forward", "runner", "execute_model"),
    ("sampler", "runner", "sample"),
    ("fetch", "runner", "fetch"),
    ("update", "scheduler", "update_from_output"),
    ("update", "engine", "_apply"),                  # an older tree's (the engine placed tokens itself)
    ("device wait", "jaxpaged.runner.model_runner", "_to_host"),   # fetch blocked on the device's results
    ("outputs", "engine", "_process_text"),          # an older tree's
    ("outputs", "engine", "_outputs"),
)

TINY_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                   torch_dtype="float32", bos_token_id=1, eos_token_id=2, hidden_act="silu")


def tiny_model(folder: str | None = None) -> str:
    """A random one-layer Llama checkpoint (config.json + safetensors, float32, no tokenizer)."""
    from safetensors.numpy import save_file

    folder = folder or os.path.join(tempfile.gettempdir(), "jaxpaged-bench-latency-model")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    os.makedirs(folder, exist_ok=True)
    c = TINY_CONFIG
    rng = np.random.default_rng(0)
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = H // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim

    def dense(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    weights = {"model.embed_tokens.weight": dense(V, H), "lm_head.weight": dense(V, H),
               "model.norm.weight": np.ones(H, np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({p + "self_attn.q_proj.weight": dense(H, H), p + "self_attn.k_proj.weight": dense(kv, H),
                        p + "self_attn.v_proj.weight": dense(kv, H), p + "self_attn.o_proj.weight": dense(H, H),
                        p + "mlp.gate_proj.weight": dense(I, H), p + "mlp.up_proj.weight": dense(I, H),
                        p + "mlp.down_proj.weight": dense(H, I), p + "input_layernorm.weight": np.ones(H, np.float32),
                        p + "post_attention_layernorm.weight": np.ones(H, np.float32)})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(c, f)
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return folder


class PhaseClock:
    """Wall times of the engine's named calls, per engine step."""

    def __init__(self, engine):
        self.engine = engine
        self.current: dict[str, float] = {}
        self.wrapped: list[tuple[object, str, object]] = []
        self.labels: list[str] = []
        for label, where, name in PHASES:
            if "." in where:   # a module's function
                owner = importlib.import_module(where)
            else:
                owner = engine if where == "engine" else getattr(engine, where, None)
            method = getattr(owner, name, None) if owner is not None else None
            if method is None or not callable(method):
                continue
            setattr(owner, name, self._timed(label, method))
            self.wrapped.append((owner, name, method))
            if label not in self.labels:
                self.labels.append(label)

    def _timed(self, label, method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[label] = self.current.get(label, 0.0) + time.perf_counter() - start
        return call

    def take(self) -> dict[str, float]:
        out, self.current = self.current, {}
        return out

    def restore(self) -> None:
        for owner, name, method in self.wrapped:
            if isinstance(owner, types.ModuleType):
                setattr(owner, name, method)
                continue
            with contextlib.suppress(AttributeError):
                delattr(owner, name)


def measure(engine, num_seqs: int, prompt_len: int, new_tokens: int, seed: int, output_kind: str = "final_only") -> dict:
    """Run num_seqs greedy sequences to new_tokens tokens; medians over the steady decode steps."""
    from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    # final_only: outputs at the end, as LLM.generate asks; delta: each step's, as a server's streams
    # (whose outputs AsyncLLM builds on a thread of its own)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind[output_kind.upper()])
    for i in range(num_seqs):
        engine.add_request(f"b{seed}-{i}", {"prompt_token_ids": rng.integers(3, vocab, prompt_len).tolist()}, params)
    clock = PhaseClock(engine)
    plans = []
    schedule = engine.scheduler.schedule

    def schedule_and_note():
        plan = schedule()
        plans.append(len(plan.chunks) == num_seqs and plan.num_batched_tokens == num_seqs)
        return plan

    engine.scheduler.schedule = schedule_and_note
    steps = []
    try:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            phases = clock.take()
            # steady: this step and the one it fetched both decode every sequence
            if len(plans) >= 2 and plans[-1] and plans[-2]:
                steps.append((wall, phases))
    finally:
        clock.restore()
        engine.scheduler.__dict__.pop("schedule", None)
    if not steps:
        raise RuntimeError(f"no steady decode step with {num_seqs} sequences (new_tokens={new_tokens} too few?)")
    # the host's share: the step less the time fetch waited for the device (the step's compute)
    out = {"seqs": num_seqs, "steps": len(steps), "step_ms": 1e3 * statistics.median(w for w, _ in steps),
           "host_ms": 1e3 * statistics.median(w - p.get("device wait", 0.0) for w, p in steps)}
    for label in clock.labels:
        out[label.replace(" ", "_") + "_ms"] = 1e3 * statistics.median(p.get(label, 0.0) for _, p in steps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxpaged bench latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: a random 1-layer, 64-wide Llama)")
    parser.add_argument("--seqs", default="32,256", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3, help="runs per batch size, alternated (median shown)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="the engine's (default: vLLM's 256, or the largest batch size if larger)")
    parser.add_argument("--output-kind", default="final_only", choices=["final_only", "delta"],
                        help="final_only (LLM.generate's) or delta (a server's streams: outputs every step)")
    parser.add_argument("--json", default=None, help="also write the runs here")
    ns = parser.parse_args(argv)

    from jaxpaged.engine.arg_utils import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine

    sizes = [int(s) for s in ns.seqs.split(",")]
    start = time.perf_counter()
    max_num_seqs = ns.max_num_seqs or max(256, *sizes)
    engine = LLMEngine(EngineArgs(model=ns.model or tiny_model(), max_num_seqs=max_num_seqs), use_tqdm=False)
    print(f"start-up {time.perf_counter() - start:.1f} s; {len(sizes)} batch sizes x {ns.repeat} runs", flush=True)
    measure(engine, sizes[0], ns.prompt_len, min(ns.new_tokens, 8), seed=-1 % 2**31)   # first calls' costs
    runs = {n: [] for n in sizes}
    for r in range(ns.repeat):
        for n in sizes:
            runs[n].append(measure(engine, n, ns.prompt_len, ns.new_tokens, seed=r * 1000 + n,
                                   output_kind=ns.output_kind))
    medians = {}
    for n in sizes:
        keys = [k for k in runs[n][0] if k.endswith("_ms")]
        medians[n] = {k: statistics.median(run[k] for run in runs[n]) for k in keys}
        steps = ", ".join(f"{run['step_ms']:.2f}" for run in runs[n])
        hosts = ", ".join(f"{run['host_ms']:.2f}" for run in runs[n])
        phases = "  ".join(f"{k[:-3]} {v:.2f}" for k, v in medians[n].items() if k not in ("step_ms", "host_ms"))
        print(f"{n:4d} seqs: step {medians[n]['step_ms']:.2f} ms (runs {steps}); host {medians[n]['host_ms']:.2f} ms "
              f"(runs {hosts})\n           phases ms: {phases}")
    if len(sizes) > 1:
        lo, hi = min(sizes), max(sizes)
        print(f"at {hi} / at {lo}: step {medians[hi]['step_ms'] / medians[lo]['step_ms']:.2f}x, "
              f"host {medians[hi]['host_ms'] / medians[lo]['host_ms']:.2f}x")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"runs": runs, "medians": medians}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
