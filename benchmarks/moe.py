"""Step time of a mixture-of-experts model: experts run on their routed tokens only, against every
expert on every token.

A Mixtral-shaped model with random weights (8 experts, hidden 512, expert intermediate 1024,
4 layers, 8 query / 4 KV heads, vocab 4096, fp32), one forward step timed (median of repeats,
after a compile): a decode step of 32 sequences and a 256-token prompt step, for top-k 1, 2, 4
and 8 with the grouped experts (`moe_impl`, default: "auto") and with every expert computed densely
("dense", which costs the same whatever k).

    python -m benchmarks.moe [--impl auto] [--repeats 10]
"""

import argparse
import dataclasses
import statistics
import time


def _config(top_k: int):
    from jaxpaged.models.config import ModelConfig

    layers = 4
    return ModelConfig(
        architecture="MixtralForCausalLM", vocab_size=4096, hidden_size=512, intermediate_size=1024,
        num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
        qk_norm=False, sliding_windows=(0,) * layers, rope_theta=1e6, rope_type="default", num_experts=8,
        num_experts_per_tok=top_k, moe_intermediate_size=1024, norm_topk_prob=True)


def _forward(cfg, impl: str, seed: int = 0):
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxpaged.models.llama import LlamaFamilyForCausalLM, layer_weight_shapes, weight_shapes

    rng = np.random.default_rng(seed)

    def rand(shape):
        return jnp.asarray(rng.normal(0, 0.05, shape) if len(shape) > 1 else np.ones(shape), jnp.float32)

    weights = {name: rand(shape) for name, shape in weight_shapes(cfg).items()}
    weights["layers"] = {n: rand((cfg.num_layers, *s)) for n, s in layer_weight_shapes(cfg).items()}
    graphdef, state = nnx.split(LlamaFamilyForCausalLM(cfg, weights, moe_impl=impl))

    @functools.partial(jax.jit, donate_argnums=1)
    def forward(state, kv_pool, batch):
        return nnx.merge(graphdef, state)(kv_pool, batch)

    return functools.partial(forward, state)


def _batches(cfg, block_size: int = 16):
    import numpy as np

    from jaxpaged.runner.batch_builder import PREFILL_Q_TILE, BatchShape, SeqChunk
    from tests.forward_batch import build_forward_batch

    rng = np.random.default_rng(1)
    decode = [SeqChunk([int(rng.integers(3, cfg.vocab_size))], 100, list(range(1 + 8 * i, 9 + 8 * i)),
                       logits_positions=[0]) for i in range(32)]
    prompt = [SeqChunk(rng.integers(3, cfg.vocab_size, 256).tolist(), 0, list(range(1, 17)), logits_positions=[255])]
    return {
        "decode 32 seqs": build_forward_batch(decode, block_size, 16, BatchShape(32, 32, 32, 1)),
        "prompt 256 tokens": build_forward_batch(prompt, block_size, 16, BatchShape(256, 4, 4, PREFILL_Q_TILE)),
    }


def _time(forward, pool, batch, repeats: int) -> float:
    import jax

    pool, logits = forward(pool, batch)   # compile
    jax.block_until_ready(logits)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pool, logits = forward(pool, batch)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="auto", help="the grouped experts' implementation (see jaxpaged.models.moe)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    import jax.numpy as jnp

    from jaxpaged.models.moe import resolve_moe_impl
    from jaxpaged.kernels import kv_pool_shape

    impl = resolve_moe_impl(args.impl)
    cfg0 = _config(2)
    batches = _batches(cfg0)
    print(f"{'top-k':>5}  {'experts':<14}" + "".join(f"{name:>20}" for name in batches) + "   (ms per step)",
          flush=True)
    dense_ms = {}
    for top_k in (1, 2, 4, 8):
        cfg = dataclasses.replace(cfg0, num_experts_per_tok=top_k)
        for label, name in ((f"grouped ({impl})", impl), ("all (dense)", "dense")):
            if name == "dense" and dense_ms:   # every expert on every token: the same work whatever k
                continue
            forward = _forward(cfg, name)
            row = []
            for batch_name, batch in batches.items():
                pool = jnp.zeros(kv_pool_shape(cfg.num_layers, 600, 16, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
                row.append(_time(forward, pool, batch, args.repeats))
            if name == "dense":
                dense_ms = dict(zip(batches, row))
            print(f"{top_k:>5}  {label:<14}" + "".join(f"{ms:>20.2f}" for ms in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
