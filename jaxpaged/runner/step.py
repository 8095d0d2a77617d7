"""The engine's jitted step: one executable per shape bucket (compiled by ModelRunner).

    step(weights, kv_pool, slots, buffer, prev_tokens, bitmask) -> (kv_pool, slots, packed, prompt_packed, tokens)

Inputs and outputs are described in model_runner.py; this module holds the traced code only.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpaged.core.kv_cache_manager import cdiv
from jaxpaged.models.batch import ForwardBatch
from jaxpaged.parallel import POOL_SPEC, ShardPlan
from jaxpaged.runner.persistent_batch import (SlotState, StepLayout, apply_step_updates, attention_metadata,
                                              count_sampled, forward_batch_arrays, sampling_metadata)
from jaxpaged.runner.sampler import greedy_from_transposed, is_plain_greedy, sample, token_logprobs


def _pack(*arrays: jax.Array) -> jax.Array:
    parts = []
    for a in arrays:
        a = a.reshape(a.shape[0], -1) if a.ndim > 1 else a[:, None]
        if jnp.issubdtype(a.dtype, jnp.integer):
            a = jax.lax.bitcast_convert_type(a.astype(jnp.int32), jnp.float32)
        parts.append(a.astype(jnp.float32))
    return jnp.concatenate(parts, axis=1).reshape(-1)


PROMPT_LOGPROB_CHUNK = 128   # prompt logprobs walk the step's tokens this many at a time
LOGIT_ROW_CHUNK = 16         # logits of a prompt step's rows are computed this many at a time


def _row_logits(compute, rows, num_rows, axis: int):
    """compute(rows) (f32 logits with the rows on `axis`), for the first `num_rows` rows only:
    LOGIT_ROW_CHUNK rows at a time while any are left, the rest zeros. num_rows None: all at once."""
    if num_rows is None:
        return compute(rows)
    S = rows.shape[0]
    chunk = min(S, LOGIT_ROW_CHUNK)
    padded = cdiv(S, chunk) * chunk
    rows = jnp.pad(rows, ((0, padded - S), (0, 0)))
    out_shape = jax.eval_shape(compute, rows[:chunk]).shape
    out = jnp.zeros(out_shape[:axis] + (padded,) + out_shape[axis + 1:], jnp.float32)

    def one(i, out):
        logits = compute(jax.lax.dynamic_slice_in_dim(rows, i * chunk, chunk, axis=0))
        return jax.lax.dynamic_update_slice_in_dim(out, logits, i * chunk, axis=axis)

    out = jax.lax.fori_loop(0, cdiv(num_rows, chunk), one, out)
    return jax.lax.slice_in_dim(out, 0, S, axis=axis)


@dataclasses.dataclass(frozen=True)
class StepStatics:
    """What a compiled step is specialised on (besides its input shapes)."""

    graphdef: object
    layout: StepLayout
    q_tile: int
    block_size: int
    num_logprobs: int
    plan: ShardPlan


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def step_fn(statics: StepStatics, state, kv_pool, slots: SlotState, buffer, prev_tokens, bitmask):
    """One engine step. buffer: i32[layout.size], every per-step input (StepLayout); slots: the
    persistent batch (block tables, sampling parameters and penalty state, donated);
    prev_tokens: i32[MAX_ROWS], the previous step's sampled tokens, of which row prev_source[i]
    becomes input token prev_index[i] (out-of-bounds indices are dropped); bitmask:
    i32[S, ceil(V / 32)], each sample row's allowed tokens (structured outputs; all ones: any).

    Returns (kv_pool, slots, packed f32[S * (3 + 2K)], prompt_packed f32[T * (2 + 2K)], tokens i32[MAX_ROWS]).
    """
    f = statics.layout.unpack(buffer)
    slots = apply_step_updates(slots, f["updates"])
    positions, slot_mapping, kv_lens, tables = forward_batch_arrays(f, slots.block_tables, statics.block_size)
    input_ids = f["input_ids"].at[f["prev_index"]].set(prev_tokens[f["prev_source"]], mode="drop")
    batch = ForwardBatch(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                         logits_indices=f["logits_indices"],
                         attn=attention_metadata(kv_lens, tables, f["cu_q_lens"], statics.q_tile))
    model = nnx.merge(statics.graphdef, state)
    kv_pool, hidden = model.hidden_states(kv_pool, batch)
    K = statics.num_logprobs
    smd = sampling_metadata(slots, f["row_slots"], K, bitmask)
    rows = hidden[batch.logits_indices]                                # [S, hidden]
    # decode buckets are at most half padding; a prompt step's many padding rows skip the matmul
    num_rows = None if statics.q_tile == 1 else jnp.sum(f["row_slots"] != slots.params.shape[0] - 1)
    out = jax.lax.cond(
        is_plain_greedy(smd),   # the common decode case, in the CPU-friendly layout
        lambda h: greedy_from_transposed(_row_logits(model.compute_logits_transposed, h, num_rows, 1), K),
        lambda h: sample(_row_logits(model.compute_logits, h, num_rows, 0), smd),
        rows)
    slots = count_sampled(slots, f["count_slots"], out.token_ids)
    packed = _pack(out.token_ids, out.logprobs, out.ranks, out.topk_ids, out.topk_logprobs)
    targets = f["prompt_targets"]
    prompt_packed = jax.lax.cond(jnp.any(targets >= 0), lambda: _prompt_logprobs(model, hidden, targets, K),
                                 lambda: jnp.zeros(hidden.shape[0] * (2 + 2 * K), jnp.float32))
    tokens = jnp.zeros(prev_tokens.shape, jnp.int32).at[:out.token_ids.shape[0]].set(out.token_ids)
    # with a mesh: the pool stays sharded by KV heads, everything else comes back replicated, so
    # the next step (compiled for exactly these shardings) takes them as they are
    plan = statics.plan
    kv_pool = plan.constrain(kv_pool, POOL_SPEC)
    slots, packed, prompt_packed, tokens = (jax.tree.map(lambda a: plan.constrain(a, P()), x)
                                            for x in (slots, packed, prompt_packed, tokens))
    return kv_pool, slots, packed, prompt_packed, tokens


def _prompt_logprobs(model, hidden, targets, K):
    """Logprob, rank and top-K of each token's next prompt token, PROMPT_LOGPROB_CHUNK tokens at a
    time (the [chunk, vocab] logits are the largest temporary)."""
    T = hidden.shape[0]
    chunk = min(T, PROMPT_LOGPROB_CHUNK)
    padded = cdiv(T, chunk) * chunk   # a token bucket capped at max_num_batched_tokens may not divide
    hidden = jnp.pad(hidden, ((0, padded - T), (0, 0)))
    targets = jnp.pad(targets, (0, padded - T))

    def one(args):
        h, t = args
        lp, rank, top_ids, top_lps = token_logprobs(model.compute_logits(h), jnp.maximum(t, 0), K)
        return _pack(lp, rank, top_ids, top_lps).reshape(chunk, -1)

    out = jax.lax.map(one, (hidden.reshape(-1, chunk, hidden.shape[1]), targets.reshape(-1, chunk)))
    return out.reshape(padded, -1)[:T].reshape(-1)
