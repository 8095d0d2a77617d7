"""gpt-oss's attention sinks (a logit per head in every softmax's sum, no value) in every kernel against the
reference (itself checked against naive attention, test_reference.py): the Mosaic GPU kernel in GPU interpret
mode, the Triton-lowered Pallas kernel in the Pallas interpreter, the Triton kernel replayed in numpy. Each
kernel leaves the sinks to the merge of its splits, so one split and several are both run."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels.mosaic_attention import ragged_paged_attention_mosaic
from jaxpaged.kernels.pallas_attention import ragged_paged_attention_pallas
from jaxpaged.kernels.reference import ragged_paged_attention_reference
from jaxpaged.kernels.triton_attention import combine_splits, kernel_call_args
from tests.kernels.cases import random_case
from tests.kernels.test_pallas_attention import assert_matches_reference
from tests.kernels.triton_emulation import replay


def triton_replayed(q, kv_pool, layer, md, sliding_window=0, soft_cap=0.0, *, sm_scale, sinks, num_kv_splits):
    del num_kv_splits   # the Triton kernel picks its own (plan_launch)
    launch, operands, _, _, tokens = kernel_call_args(q, kv_pool, layer, md, sliding_window, soft_cap,
                                                      sm_scale=sm_scale, kv_chunk_blocks=2)
    acc, m, l = replay(operands, launch, sm_scale)
    return combine_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), launch, tokens, q.dtype, sinks)


KERNELS = {
    "mosaic": functools.partial(ragged_paged_attention_mosaic, interpret=True),
    "pallas_triton": functools.partial(ragged_paged_attention_pallas, interpret=True, kv_chunk_blocks=2),
    "triton": triton_replayed,
}


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_add_the_sinks_as_the_reference_does(kernel, splits):
    rng = np.random.default_rng(40 + splits)
    q, kv_pool, layer, md, kwargs = random_case(rng, head_dim=64, group=2, block_size=16, num_seqs=3,
                                                dtype=jnp.float32, sliding_window=20, q_tile=4)
    sinks = jnp.asarray([-1.0, 0.5, 2.5, 6.0], jnp.float32)   # [kv_heads 2 x group 2], some above the scores
    ref = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs, sinks=sinks)
    out = KERNELS[kernel](q, kv_pool, layer, md, **kwargs, sinks=sinks, num_kv_splits=splits)
    assert out.shape == q.shape
    assert_matches_reference(out, ref, md, jnp.float32)
    plain = ragged_paged_attention_reference(q, kv_pool, layer, md, **kwargs)
    assert np.abs(np.asarray(ref) - np.asarray(plain))[:int(md.cu_q_lens[-1])].max() > 0.1
