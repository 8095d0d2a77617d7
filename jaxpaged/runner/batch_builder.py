"""Bucketed step shapes, and each sequence's share of a step (SeqChunk).

`choose_shape` picks a step's bucket. The runner builds the step's batch on the device from its
persistent batch and packed input (step_input.forward_batch_arrays); tests/forward_batch.py packs the
same batch on the host, the reference it is tested against.

Buckets keep the number of compiled shapes small: tokens per step and sequences per step
are rounded up to powers of two (from a floor), block tables always have
`max_blocks_per_seq` columns (attention loops only over the blocks in use), and the query
tile is 1 for decode-only steps and `PREFILL_Q_TILE` otherwise; decode-only steps are also
flagged in the metadata (`decode_only`) so that the reference attention walks their pages flat.
"""

import dataclasses

PREFILL_Q_TILE = 16


def next_bucket(n: int, floor: int, cap: int | None = None, growth: int = 2) -> int:
    """Smallest `floor * growth**k` that is >= n (capped at `cap` when given)."""
    size = floor
    while size < n:
        size *= growth
    if cap is not None:
        size = min(size, max(cap, n))
    return size


def bucket_sizes(floor: int, cap: int, growth: int = 2) -> list[int]:
    """Every size next_bucket gives from `floor` up to `cap`: floor, growth * floor, ..., cap."""
    out = [min(floor, cap)]
    while out[-1] < cap:
        out.append(min(out[-1] * growth, cap))
    return out


@dataclasses.dataclass
class SeqChunk:
    """One sequence's share of a step: its new tokens and where its KV lives."""

    token_ids: list[int]      # the new tokens this step computes
    start_pos: int            # absolute position of token_ids[0] (= tokens already in the pool)
    block_ids: list[int]      # the sequence's block table (covers start_pos + len(token_ids))
    logits_positions: list[int] = dataclasses.field(default_factory=list)  # offsets in token_ids
    rope_len: int = 0         # the sequence's length when its K/V began (ForwardBatch.rope_lens)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    num_tokens: int
    num_seqs: int
    num_logits: int   # logits rows, one per sample row: num_seqs, or num_tokens with a row per token (speculation)
    q_tile: int


def choose_shape(chunks: list[SeqChunk], token_floor: int = 8, seq_floor: int = 4,
                 max_tokens: int | None = None, max_seqs: int | None = None,
                 num_sample_rows: int = 0, row_per_token: bool = False,
                 max_decode_seqs: int | None = None) -> BatchShape:
    """Bucketed shape for `chunks`; `num_sample_rows` > len(chunks) when n > 1 forks sample extra rows.
    `row_per_token` (speculative decoding): a step with a chunk of several tokens has a sample row
    for each of its tokens (each draft token is verified by its own row); a decode-only step may
    then hold up to `max_decode_seqs` one-token queries (default: max_seqs)."""
    total = sum(len(c.token_ids) for c in chunks)
    decode_only = all(len(c.token_ids) == 1 for c in chunks)
    return shape_for(total, len(chunks), decode_only, token_floor, seq_floor, max_tokens, max_seqs, num_sample_rows,
                     row_per_token, max_decode_seqs)


def shape_for(num_tokens: int, num_seqs: int, decode_only: bool, token_floor: int = 8, seq_floor: int = 4,
              max_tokens: int | None = None, max_seqs: int | None = None, num_sample_rows: int = 0,
              row_per_token: bool = False, max_decode_seqs: int | None = None) -> BatchShape:
    """choose_shape from counts: `num_tokens` new tokens in `num_seqs` sequences (each one token
    when `decode_only`)."""
    # n > 1: forks sample beside their parent; the scheduler counts their seats in max_num_seqs
    rows = max(num_seqs, num_sample_rows)
    if decode_only:
        bucket = next_bucket(rows, seq_floor, max_decode_seqs or max_seqs)
        return BatchShape(bucket, bucket, bucket, 1)
    # A step with a prompt chunk has one sequence bucket per token bucket, as many rows as it
    # could hold sequences: one compiled variant per token bucket. Padding rows cost no logits
    # matmul (the runner computes logits for the rows in use only).
    bucket = next_bucket(max(num_tokens, rows), token_floor, max_tokens)
    seqs = num_seqs if row_per_token else rows   # (rows have their own bucket then)
    seq_bucket = bucket if max_seqs is None else min(bucket, max(max_seqs, seqs))
    return BatchShape(bucket, seq_bucket, bucket if row_per_token else seq_bucket, PREFILL_Q_TILE)
