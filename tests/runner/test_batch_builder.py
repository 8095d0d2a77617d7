"""Batch building: the decode-only flag that sends a step down the reference's flat page walk."""

import numpy as np
import pytest

from jaxpaged.runner.batch_builder import BatchShape, SeqChunk, choose_shape
from tests.forward_batch import build_forward_batch


def _batch(chunks, shape=None):
    shape = shape or choose_shape(chunks, token_floor=16, seq_floor=4)
    return build_forward_batch(chunks, block_size=8, max_blocks_per_seq=8, shape=shape)


def test_decode_steps_are_flagged_and_steps_with_a_prompt_chunk_are_not():
    decodes = [SeqChunk([5], 9, [1, 2], [0]), SeqChunk([7], 3, [3], [0])]
    assert _batch(decodes).attn.decode_only
    assert _batch(decodes).attn.q_tile == 1
    mixed = decodes + [SeqChunk([1, 2, 3], 0, [4], [2])]
    assert not _batch(mixed).attn.decode_only
    # a one-token prompt is a decode-shaped step too: one query per sequence
    assert _batch([SeqChunk([9], 0, [4], [0])]).attn.decode_only


def test_warm_up_batches_take_the_flag_from_their_shape():
    assert build_forward_batch([], 8, 8, BatchShape(4, 4, 4, 1)).attn.decode_only
    assert not build_forward_batch([], 8, 8, BatchShape(16, 4, 4, 16)).attn.decode_only


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("max_seqs, max_tokens", [(256, 2048), (16, 512), (10, 100), (8, 64)])
def test_every_step_shape_is_one_compiled_at_startup(max_seqs, max_tokens, k):
    """k > 0 (speculative decoding): decodes carry up to k drafts, laid out as one-token queries
    when no prompt chunk runs beside them, else as chunks with a sample row per token."""
    import types

    from jaxpaged.runner.model_runner import SEQ_FLOOR, TOKEN_FLOOR, ModelRunner, max_decode_queries

    decode_cap = max_decode_queries(max_seqs, max_tokens, k)
    compiled = set(ModelRunner.warmup_shapes(types.SimpleNamespace(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                                                   speculative=k > 0, max_decode_seqs=decode_cap)))
    rng = np.random.default_rng(max_seqs)
    for _ in range(3000):
        num_seqs = int(rng.integers(1, max_seqs + 1))
        decode = rng.random() < 0.3
        lengths = [1] * num_seqs if decode else rng.integers(1, 40, num_seqs).tolist()
        drafts = rng.integers(0, k + 1, num_seqs) * (np.asarray(lengths) == 1) if k else np.zeros(num_seqs, int)
        rows = [n if d == 0 else d + 1 for n, d in zip(lengths, drafts)]
        if sum(rows) > max_tokens:
            continue
        if decode:   # one-token queries, one sample row each
            chunks = [SeqChunk([0], 0, [1], [0]) for _ in range(sum(rows))]
        else:
            chunks = [SeqChunk([0] * r, 0, [1], [r - 1]) for r in rows]
        forks = int(rng.integers(0, max_seqs - num_seqs + 1))   # seats the scheduler kept for n > 1
        sample_rows = sum(d + 1 for d in drafts) + forks
        shape = choose_shape(chunks, TOKEN_FLOOR, SEQ_FLOOR, max_tokens, max_seqs, sample_rows,
                             row_per_token=k > 0, max_decode_seqs=decode_cap)
        assert shape in compiled, (lengths, forks, shape)
