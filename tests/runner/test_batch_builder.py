"""Batch building: the decode-only flag that sends a step down the reference's flat page walk."""

from jaxpaged.runner.batch_builder import BatchShape, SeqChunk, build_forward_batch, choose_shape


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
