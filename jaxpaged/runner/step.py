"""The engine's jitted step, in three executables (compiled by ModelRunner):

    forward(weights, kv_pool, slots, buffer, prev_tokens) -> (kv_pool, slots, rows, hidden)
    sample(weights, slots, rows, bitmask)                 -> (slots, packed, tokens)
    prompt_logprobs(weights, hidden, targets)             -> packed prompt logprobs

one forward per shape bucket and one sampler per sample-row count; the third runs only for steps
whose requests ask for prompt logprobs (one per step token count, compiled at start-up with the
rest unless the runner is greedy_only). The split lets the host fill a structured-output bitmask
while the forward runs (vLLM V1's execute_model / sample_tokens). Prompt logprobs are their own
program on every platform: as a `lax.cond` inside the forward they would be a fifth of its compile
time, which an engine compiling its steps as they come (compile_on_startup=False) spends only when asked.

Branches: on a CPU the sampler skips the work a batch does not need with `lax.cond` (the
plain-greedy fast path). XLA:GPU evaluates a conditional's predicate on the host, which waits for
the device to finish everything queued before it: the host could not run ahead of the device (an
H200 trace: each forward's dispatch blocked the host for the whole forward). There
(`host_branches`) the host, which knows the batch, picks instead: the sampler is compiled in
SAMPLER_KINDS and the host picks per step:
"greedy" (every row plain greedy: no conditional), "untruncated" (no row with top-k or top-p: the
rest runs branch-free, row-masked), "general" (the conditionals, as on a CPU).

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
from jaxpaged.runner.persistent_batch import SlotState, apply_step_updates
from jaxpaged.runner.step_input import (StepLayout, attention_metadata, count_sampled, emitted_rows,
                                        forward_batch_arrays, sampling_metadata)
from jaxpaged.runner.sampler import SamplerLayout, is_plain_greedy, plain_greedy, sample, token_logprobs


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
    """What a compiled forward is specialised on (besides its input shapes)."""

    graphdef: object
    layout: StepLayout
    q_tile: int
    block_size: int
    plan: ShardPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleRows:
    """What the forward hands the sampler, one entry per sample row (left on the device)."""

    hidden: jax.Array        # [S, hidden]: the hidden state of the token whose logits the row samples from
    row_slots: jax.Array     # i32[S]: the slot whose sampling parameters the row reads
    count_slots: jax.Array   # i32[S]: the slot that counts the row's token (out of bounds: it counts nowhere)
    drafts: jax.Array        # i32[S]: the draft token the row verifies (speculative decoding; -1: none)
    first: jax.Array         # i32[S]: the first row of the row's sequence (its own index unless speculating)


SAMPLER_KINDS = ("general", "untruncated", "greedy")


@dataclasses.dataclass(frozen=True)
class SampleStatics:
    """What a compiled sampler is specialised on: besides these, only the sample-row count S."""

    graphdef: object
    skip_padding: bool       # a prompt step's rows are mostly padding: their logits are skipped
    num_logprobs: int
    max_rows: int            # the next step's in-flight tokens: i32[max_rows]
    plan: ShardPlan
    kind: str | None = None  # one of SAMPLER_KINDS, picked by the host; None: lax.cond picks the greedy path
    layout: SamplerLayout = SamplerLayout()   # the platform's (SamplerLayout.for_platform)
    logprobs_mode: str = "raw_logprobs"       # vLLM's: what the logprobs hold (sampler.LOGPROBS_MODES)
    logits_processors: object = None          # custom ones (jaxpaged.logits_processor.LogitsProcessors), or None


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def forward_fn(statics: StepStatics, state, kv_pool, slots: SlotState, buffer, prev_tokens, embeds=None,
               mrope=None):
    """The first half of an engine step: everything up to the sample rows' hidden states.
    buffer: i32[layout.size], every per-step input (StepLayout); slots: the persistent batch
    (block tables, sampling parameters and penalty state, donated); prev_tokens: i32[MAX_ROWS],
    the previous step's sampled tokens, of which row prev_source[i] becomes input token
    prev_index[i] (out-of-bounds indices are dropped); embeds: [T, hidden] prompt-embedding rows,
    read for tokens whose id is -1 (None: an engine without enable_prompt_embeds); mrope: i32[T, 3], M-RoPE
    offsets (Request.mrope_offsets) added, with each sequence's mrope_delta, to the positions (None: an engine
    without M-RoPE images).

    Returns (kv_pool, slots, SampleRows, hidden [T, hidden], kv_scales f32[L, 2]): hidden, every
    token's hidden state (prompt_logprobs_fn's input, when a request asks); kv_scales, the fp8 KV
    scales the step wrote with (calibrated by this step where they were 0).
    """
    f = statics.layout.unpack(buffer)
    slots = apply_step_updates(slots, f["updates"])
    positions, slot_mapping, kv_lens, tables, lora_index, rope_lens, mrope_delta = forward_batch_arrays(
        f, slots.block_tables, statics.block_size, slots.params)
    mrope_positions = None if mrope is None else positions[:, None] + mrope_delta[:, None] + mrope
    input_ids = f["input_ids"].at[f["prev_index"]].set(prev_tokens[f["prev_source"]], mode="drop")
    batch = ForwardBatch(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                         logits_indices=f["logits_indices"],
                         attn=attention_metadata(kv_lens, tables, f["cu_q_lens"], statics.q_tile),
                         rope_lens=rope_lens, lora_index=lora_index, input_embeds=embeds,
                         mrope_positions=mrope_positions)
    model = nnx.merge(statics.graphdef, state)
    kv_pool, hidden = model.hidden_states(kv_pool, batch)
    rows = SampleRows(hidden[batch.logits_indices], f["row_slots"], f["count_slots"], f["row_draft"],
                      f["row_first"])
    # with a mesh: the pool stays sharded by KV heads, everything else comes back replicated, so
    # the sampler and the next step (compiled for exactly these shardings) take them as they are
    plan = statics.plan
    kv_pool = plan.constrain(kv_pool, POOL_SPEC)
    slots, rows, hidden, kv_scales = (jax.tree.map(lambda a: plan.constrain(a, P()), x)
                                      for x in (slots, rows, hidden, model.kv_scales[...]))
    return kv_pool, slots, rows, hidden, kv_scales


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def sample_fn(statics: SampleStatics, state, slots: SlotState, rows: SampleRows, bitmask, custom=None):
    """The second half of an engine step: LM head and sampler. bitmask: i32[S, ceil(V / 32)],
    each sample row's allowed tokens (structured outputs; all ones: any), filled on the host
    while the forward runs. custom: the custom logits processors' claims and states
    (LogitsProcessors.device_state; None without processors).

    Speculative decoding: a row with a draft token verifies it (sampler.sample); only the rows up to
    each sequence's first rejection count their token (emitted_rows).

    Returns (slots, packed f32[S * (4 + 2K)], tokens i32[max_rows]).
    """
    model = nnx.merge(statics.graphdef, state)
    K = statics.num_logprobs
    S = rows.row_slots.shape[0]
    smd = sampling_metadata(slots, rows.row_slots, K, bitmask, rows.drafts,
                            jnp.arange(S, dtype=jnp.int32) - rows.first)
    # decode buckets are at most half padding; a prompt step's many padding rows skip the matmul
    num_rows = jnp.sum(rows.row_slots != slots.params.shape[0] - 1) if statics.skip_padding else None
    layout, mode = statics.layout, statics.logprobs_mode

    def greedy(h):   # the common decode case
        if layout.vocab_major_greedy:
            return plain_greedy(_row_logits(model.compute_logits_transposed, h, num_rows, 1), 0, K,
                                smd.draft_tokens, layout, mode)
        return plain_greedy(_row_logits(model.compute_logits, h, num_rows, 0), 1, K, smd.draft_tokens, layout, mode)

    process = None if statics.logits_processors is None else functools.partial(   # custom logits processors
        statics.logits_processors.apply, state=custom, slots=rows.row_slots, num_output_tokens=smd.steps,
        output_tokens=slots.output_tokens)

    def general(h, branch_free=False):
        return sample(_row_logits(model.compute_logits, h, num_rows, 0), smd, branch_free, layout, mode, process)

    if statics.kind is None:
        out = jax.lax.cond(is_plain_greedy(smd), greedy, general, rows.hidden)
    elif statics.kind == "greedy":
        out = greedy(rows.hidden)
    else:
        out = general(rows.hidden, branch_free=statics.kind == "untruncated")
    emitted = emitted_rows(rows.drafts, out.accepted, rows.first)
    slots = count_sampled(slots, jnp.where(emitted, rows.count_slots, slots.params.shape[0]), out.token_ids)
    packed = _pack(out.token_ids, out.logprobs, out.ranks, out.topk_ids, out.topk_logprobs,
                   out.accepted.astype(jnp.int32))
    n = min(S, statics.max_rows)   # a speculative step's rows may outnumber them (nothing reads those)
    tokens = jnp.zeros(statics.max_rows, jnp.int32).at[:n].set(out.token_ids[:n])
    plan = statics.plan
    slots, packed, tokens = (jax.tree.map(lambda a: plan.constrain(a, P()), x) for x in (slots, packed, tokens))
    return slots, packed, tokens


@dataclasses.dataclass(frozen=True)
class PromptStatics:
    graphdef: object
    num_logprobs: int
    plan: ShardPlan


@functools.partial(jax.jit, static_argnums=(0,))
def prompt_logprobs_fn(statics: PromptStatics, state, hidden, targets):
    """A step's prompt logprobs from the forward's hidden states (run only for steps with a token
    asking). targets: i32[T], each token's next prompt token (-1: not asked).
    Returns f32[T * (2 + 2K)]: per token its logprob, rank and top-K (read only where asked)."""
    model = nnx.merge(statics.graphdef, state)
    packed = _prompt_logprobs(model, hidden, targets, statics.num_logprobs)
    return statics.plan.constrain(packed, P())


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
