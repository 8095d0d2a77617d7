"""Random ragged paged-attention cases shared by the kernel tests (Pallas, Triton).

A case is what the engine would hand a kernel in one step, made deliberately hostile:

- pages of every sequence are scattered through a shuffled pool, block 0 is the null block;
- everything that is not a sequence's live KV (free blocks, the other layers, slots past
  kv_len in a last page) holds large finite garbage, so a kernel that reads a wrong page
  or forgets a mask is far off;
- q_lens mix decodes (1 token) and prompt chunks (or are all decodes, flagged `decode_only`),
  kv_lens land on and just past block boundaries, trailing padded sequences have
  q_len = kv_len = 0;
- padded tokens after cu_q_lens[-1] are NaN: their output is unused, but a kernel that
  lets them leak into other rows fails every comparison.
"""

import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.layout import kv_pool_shape
from jaxpaged.kernels.metadata import AttentionMetadata

_GARBAGE = 1e3


def random_lengths(rng: np.random.Generator, num_seqs: int, block_size: int,
                   max_blocks: int = 3) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) of live sequences: about half decodes, the rest prompt chunks."""
    q_lens, kv_lens = [], []
    for _ in range(num_seqs):
        q_len = 1 if rng.random() < 0.5 else int(rng.integers(2, 2 * block_size + 2))
        blocks = int(rng.integers(1, max_blocks + 1))
        # On a boundary, one past it, or anywhere: the off-by-one cases of page walking.
        kv_len = int(rng.choice([blocks * block_size, blocks * block_size + 1,
                                 int(rng.integers(1, (blocks + 1) * block_size))]))
        q_lens.append(q_len)
        kv_lens.append(max(kv_len, q_len))
    return q_lens, kv_lens


def random_case(rng: np.random.Generator, *, head_dim: int, group: int, block_size: int, num_seqs: int,
                dtype, sliding_window: int = 0, soft_cap: float = 0.0, kv_heads: int = 2,
                num_layers: int = 2, q_tile: int | None = None, pad_tokens: int = 3, pad_seqs: int = 1,
                decode_only: bool = False, max_blocks_per_seq: int = 3):
    """Returns (q, kv_pool, layer, md, kwargs); call kernel(q, kv_pool, layer, md, **kwargs).

    kwargs holds sliding_window (an i32 array, as the model passes it), soft_cap and sm_scale.
    The layer read is the last one, so a kernel that ignores `layer` reads garbage.
    `decode_only` gives every live sequence one query and sets the metadata flag.
    """
    q_lens, kv_lens = random_lengths(rng, num_seqs, block_size, max_blocks_per_seq)
    if decode_only:
        q_lens = [1] * num_seqs
    q_lens += [0] * pad_seqs               # padded sequences, as bucketing produces
    kv_lens += [0] * pad_seqs
    blocks_per_seq = [-(-n // block_size) for n in kv_lens]
    max_blocks = max(blocks_per_seq) + 1   # one trailing column of padding (block 0)
    num_blocks = 1 + sum(blocks_per_seq) + int(rng.integers(1, 4))
    free_ids = rng.permutation(np.arange(1, num_blocks))

    pool = rng.uniform(-_GARBAGE, _GARBAGE, kv_pool_shape(num_layers, num_blocks, block_size, kv_heads, head_dim))
    pool = pool.astype(np.float32)
    layer = num_layers - 1
    block_tables = np.zeros((len(kv_lens), max_blocks), np.int32)
    next_free = 0
    for i, (kv_len, num) in enumerate(zip(kv_lens, blocks_per_seq)):
        ids = free_ids[next_free:next_free + num]
        next_free += num
        block_tables[i, :num] = ids
        for pos in range(kv_len):
            block, offset = ids[pos // block_size], pos % block_size
            pool[layer, :, block, :, offset] = rng.standard_normal((2, kv_heads, head_dim))

    num_heads = kv_heads * group
    live_tokens = sum(q_lens)
    q = rng.standard_normal((live_tokens + pad_tokens, num_heads, head_dim)).astype(np.float32)
    q[live_tokens:] = np.nan
    if q_tile is None:
        q_tile = 1 if max(q_lens) == 1 else int(rng.choice([2, 4, 8]))
    md = AttentionMetadata(
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        q_tile=q_tile,
        decode_only=decode_only,
    )
    kwargs = dict(sliding_window=jnp.int32(sliding_window), soft_cap=soft_cap, sm_scale=head_dim ** -0.5)
    return jnp.asarray(q, dtype), jnp.asarray(pool, dtype), jnp.int32(layer), md, kwargs


def live_tokens(md: AttentionMetadata) -> int:
    """Tokens whose output is used: the rows to compare (padded tokens come after them)."""
    return int(md.cu_q_lens[-1])
