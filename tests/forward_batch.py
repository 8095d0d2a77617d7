"""A ForwardBatch packed on the host from SeqChunks: what model tests (and repository tools) feed a
model's forward directly, and the reference the engine's device-built batch is tested against (the
runner builds positions, slot mapping and block tables on the device from its persistent batch and
packed input: jaxpaged/runner/step_input.py)."""

import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels import AttentionMetadata
from jaxpaged.models.batch import ForwardBatch
from jaxpaged.runner.batch_builder import BatchShape, SeqChunk

__all__ = ["BatchShape", "SeqChunk", "build_forward_batch"]


def build_forward_batch(chunks: list[SeqChunk], block_size: int, max_blocks_per_seq: int,
                        shape: BatchShape, logits_indices: list[int] | None = None) -> ForwardBatch:
    """Padded arrays for `chunks`; logits rows come out in chunk order (padding rows point at token 0).

    `logits_indices` (flat token indices, e.g. one per sample row with n > 1 forks repeating
    their parent's) replaces the rows the chunks' `logits_positions` would give."""
    T, S = shape.num_tokens, shape.num_seqs
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    rope_lens = np.zeros(T, np.int32)
    slot_mapping = np.full(T, -1, np.int32)
    kv_lens = np.zeros(S, np.int32)
    cu_q_lens = np.zeros(S + 1, np.int32)
    block_tables = np.zeros((S, max_blocks_per_seq), np.int32)
    wanted = logits_indices
    logits_indices = np.zeros(shape.num_logits, np.int32)
    if wanted is not None:
        logits_indices[:len(wanted)] = wanted
    t = 0
    n_logits = 0
    for i, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        end = chunk.start_pos + n
        blocks = np.asarray(chunk.block_ids, np.int32)
        if len(blocks) * block_size < end:
            raise ValueError(f"sequence {i}: {len(blocks)} blocks cannot hold {end} tokens")
        pos = np.arange(chunk.start_pos, end, dtype=np.int32)
        input_ids[t:t + n] = chunk.token_ids
        positions[t:t + n] = pos
        rope_lens[t:t + n] = max(chunk.rope_len, end)
        slot_mapping[t:t + n] = blocks[pos // block_size] * block_size + pos % block_size
        kv_lens[i] = end
        block_tables[i, :len(blocks)] = blocks
        for p in chunk.logits_positions if wanted is None else ():
            logits_indices[n_logits] = t + p
            n_logits += 1
        t += n
        cu_q_lens[i + 1] = t
    cu_q_lens[len(chunks) + 1:] = t
    # Warm-up builds all-padding batches: their shape says which step they compile for.
    decode_only = all(len(c.token_ids) == 1 for c in chunks) if chunks else shape.q_tile == 1
    attn = AttentionMetadata(kv_lens=jnp.asarray(kv_lens), block_tables=jnp.asarray(block_tables),
                             cu_q_lens=jnp.asarray(cu_q_lens), q_tile=shape.q_tile, decode_only=decode_only)
    return ForwardBatch(input_ids=jnp.asarray(input_ids), positions=jnp.asarray(positions),
                        slot_mapping=jnp.asarray(slot_mapping), logits_indices=jnp.asarray(logits_indices),
                        attn=attn, rope_lens=jnp.asarray(rope_lens))
