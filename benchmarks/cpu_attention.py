"""The native CPU attention kernel against the jnp reference, attention alone, on SmolLM2's heads.

    python -m benchmarks.cpu_attention

Each case runs 30 layers of ragged paged attention (a `fori_loop`, each layer reading its own plane
of one f32 pool: 9 query heads, 3 KV heads, head_dim 64, blocks of 16 tokens, pages scattered
through the pool) in one jitted call; best and median of 10 calls after one to compile.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.cpu_attention import ragged_paged_attention_cpu
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import ragged_paged_attention_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def make_case(rng, q_lens: list[int], kv_lens: list[int], num_tokens: int, num_blocks: int):
    tables = np.zeros((len(q_lens), -(-max(kv_lens) // BLOCK)), np.int32)
    free = rng.permutation(num_blocks - 1) + 1
    used = 0
    for i, kv_len in enumerate(kv_lens):
        n = -(-kv_len // BLOCK)
        tables[i, :n] = free[used:used + n]
        used += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables), jnp.asarray(cu), 16,
                           max(q_lens) == 1)
    return jnp.asarray(rng.standard_normal((num_tokens, HEADS, HEAD_DIM), np.float32)), md


def time_layers(kernel, q, pool, md, calls: int = 10) -> tuple[float, float, np.ndarray]:
    @jax.jit
    def layers(q, pool, md):
        def body(layer, acc):
            return acc + kernel(q + acc * 1e-3, pool, layer, md, 0, 0.0, sm_scale=HEAD_DIM ** -0.5)
        return jax.lax.fori_loop(0, LAYERS, body, jnp.zeros_like(q))

    out = layers(q, pool, md).block_until_ready()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        layers(q, pool, md).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times), float(np.median(times)), np.asarray(out)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    rng = np.random.default_rng(0)
    num_blocks = 2048   # 1.2 GB of f32 pool
    pool = jnp.asarray(rng.standard_normal((LAYERS, 2, num_blocks, KV_HEADS, BLOCK, HEAD_DIM), np.float32))
    prompts = [int(n) for n in rng.integers(8, 129, 32)]
    cases = {
        "32 decodes, contexts 100-380": ([1] * 32, [int(n) for n in rng.integers(100, 381, 32)], 32),
        "64 decodes (contexts 300) + a 128-token chunk": ([1] * 64 + [128], [300] * 64 + [128], 256),
        "32 prompts of 8-128 tokens": (prompts, prompts, 4096),
        "one prompt of 1024 tokens": ([1024], [1024], 1024),
    }
    print(f"{'case (30 layers)':48s} {'cpu best/median ms':>20s} {'reference best/median ms':>26s} {'ratio':>6s}")
    for name, (q_lens, kv_lens, num_tokens) in cases.items():
        q, md = make_case(rng, q_lens, kv_lens, num_tokens, num_blocks)
        ours = time_layers(ragged_paged_attention_cpu, q, pool, md)
        ref = time_layers(ragged_paged_attention_reference, q, pool, md)
        live = int(md.cu_q_lens[-1])
        err = float(np.abs(ours[2][:live] - ref[2][:live]).max())
        print(f"{name:48s} {ours[0] * 1e3:9.1f} / {ours[1] * 1e3:7.1f} {ref[0] * 1e3:13.1f} / {ref[1] * 1e3:8.1f} "
              f"{ref[1] / ours[1]:5.2f}x  (max abs difference {err:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
