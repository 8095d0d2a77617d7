"""Batch metadata that every attention kernel reads: a ragged batch over the paged pool."""

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's queries sit in the flat token batch and where its KV lives.

    Sequence i owns query tokens cu_q_lens[i]:cu_q_lens[i+1] of the flat batch; they are its
    last q_len tokens, so query j of sequence i sits at absolute position
    kv_lens[i] - q_len_i + j (the causal mask is offset by kv_len - q_len). Padded sequences
    have q_len 0 and kv_len 0.
    """

    kv_lens: jax.Array       # i32[num_seqs]  tokens in the pool for each sequence, this step's included
    block_tables: jax.Array  # i32[num_seqs, max_blocks_per_seq]  pool block ids; padding points at block 0
    cu_q_lens: jax.Array     # i32[num_seqs + 1]  prefix sums of query lengths
    # Queries are processed in tiles of q_tile tokens of one sequence: 1 for decode-only
    # batches (no padding waste), larger when some sequence brings a prompt chunk.
    q_tile: int = dataclasses.field(default=1, metadata=dict(static=True))
    # Every sequence has at most one query token (q_len <= 1): the reference then walks the
    # batch's pages as one flat list instead of tile by tile. Trusted, not checked (the lengths
    # are traced); the GPU kernels ignore it.
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
