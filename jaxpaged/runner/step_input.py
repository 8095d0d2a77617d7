"""A step's packed input: one i32 buffer per step (StepLayout: where each field sits, a pure function
of the bucket), and how the traced step reads it beside the persistent batch (persistent_batch.py):
positions, slot mapping and attention metadata, the sampler's inputs, the rows a verified step
keeps, the counts of sampled tokens."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels import AttentionMetadata
from jaxpaged.runner.persistent_batch import (NUM_PARAMS, P_CUSTOM, P_FREQUENCY, P_HAS_BIAS, P_LOGPROBS, P_MIN_P,
                                              P_MIN_TOKENS, P_MROPE_DELTA, P_PRESENCE, P_REPETITION, P_ROPE_LEN,
                                              P_SEED, P_STEPS, P_TEMPERATURE, P_TOP_K, P_TOP_P, UPDATE_WIDTH,
                                              SlotState)
from jaxpaged.runner.sampler import SamplingMetadata


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Where each field sits in a step's one i32 input buffer (a pure function of the bucket)."""

    num_tokens: int
    num_seqs: int
    num_rows: int | None = None   # sample rows (None: one per sequence); speculative decoding: one per token

    @classmethod
    def of(cls, shape) -> "StepLayout":
        """The layout of a BatchShape's step."""
        return cls(shape.num_tokens, shape.num_seqs, shape.num_logits)

    @property
    def rows(self) -> int:
        return self.num_seqs if self.num_rows is None else self.num_rows

    @property
    def num_updates(self) -> int:
        """TABLE/PARAM updates the step itself applies (more go through apply_updates): a table entry per token
        and two per sequence, and the parameters of half its sequences and one more taking a slot."""
        return self.num_tokens + 2 * self.num_seqs + NUM_PARAMS * (1 + self.num_seqs // 2)

    @functools.cached_property
    def fields(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, size) in the buffer."""
        T, S, R = self.num_tokens, self.num_seqs, self.rows
        sizes = dict(input_ids=T, prompt_targets=T, seq_slots=S, start_pos=S, cu_q_lens=S + 1, seq_lora=S,
                     logits_indices=R, row_slots=R, count_slots=R, row_draft=R, row_first=R,
                     prev_index=S, prev_source=S,
                     updates=self.num_updates * UPDATE_WIDTH)
        out, offset = {}, 0
        for name, size in sizes.items():
            out[name] = (offset, size)
            offset += size
        return out

    @property
    def size(self) -> int:
        offset, size = self.fields["updates"]
        return offset + size

    def empty(self, pad_slot: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A buffer (i32[size]) holding an all-padding step, and writable views of its fields."""
        buffer = np.zeros(self.size, np.int32)
        v = {name: buffer[o:o + n] for name, (o, n) in self.fields.items()}
        v["updates"] = v["updates"].reshape(-1, UPDATE_WIDTH)
        v["prompt_targets"][:] = -1
        v["seq_slots"][:] = pad_slot
        v["seq_lora"][:] = -1                     # the base model (multi-LoRA: the sequence's adapter slot)
        v["row_slots"][:] = pad_slot
        v["count_slots"][:] = pad_slot + 1        # out of bounds: nothing counted
        v["row_draft"][:] = -1                    # no draft token to verify
        v["row_first"][:] = np.arange(self.rows)  # each row its own sequence's first row
        v["prev_index"][:] = self.num_tokens      # out of bounds: nothing handed over
        v["updates"][:] = -1
        return buffer, v

    def unpack(self, buffer: jax.Array) -> dict[str, jax.Array]:
        """Traced: the fields of `buffer` as arrays."""
        out = {name: buffer[o:o + n] for name, (o, n) in self.fields.items()}
        out["updates"] = out["updates"].reshape(-1, UPDATE_WIDTH)
        return out


def forward_batch_arrays(fields: dict, block_tables: jax.Array, block_size: int, params: jax.Array):
    """Traced: positions, slot mapping and attention metadata from the packed per-sequence
    fields and the persistent block tables and parameter rows. Returns (positions, slot_mapping,
    kv_lens, tables, lora_index, rope_lens, mrope_delta): lora_index, each token's LoRA slot (-1: the base
    model; padding tokens too); rope_lens, ForwardBatch.rope_lens; mrope_delta, its sequence's M-RoPE delta."""
    cu = fields["cu_q_lens"]
    start = fields["start_pos"]
    S = start.shape[0]
    T = fields["input_ids"].shape[0]
    kv_lens = start + (cu[1:] - cu[:-1])
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), S - 1).astype(jnp.int32)
    valid = t < cu[S]
    positions = jnp.where(valid, start[seq] + t - cu[seq], 0)
    tables = block_tables[fields["seq_slots"]]                                   # [S, max_blocks]
    in_use = jnp.arange(tables.shape[1])[None, :] * block_size < kv_lens[:, None]
    tables = jnp.where(in_use, tables, 0)   # a slot's row may still hold a previous owner's tail
    block = tables[seq, positions // block_size]
    slot_mapping = jnp.where(valid, block * block_size + positions % block_size, -1)
    lora_index = jnp.where(valid, fields["seq_lora"][seq], -1)
    rope_lens = jnp.maximum(params[fields["seq_slots"], P_ROPE_LEN], kv_lens)[seq]
    mrope_delta = params[fields["seq_slots"], P_MROPE_DELTA][seq]
    return positions, slot_mapping, kv_lens, tables, lora_index, rope_lens, mrope_delta


def attention_metadata(kv_lens, tables, cu_q_lens, q_tile: int) -> AttentionMetadata:
    return AttentionMetadata(kv_lens=kv_lens, block_tables=tables, cu_q_lens=cu_q_lens, q_tile=q_tile,
                             decode_only=q_tile == 1)


def sampling_metadata(state: SlotState, row_slots: jax.Array, num_logprobs: int,
                      bitmask: jax.Array | None = None, drafts: jax.Array | None = None,
                      offsets: jax.Array | None = None) -> SamplingMetadata:
    """Traced: the sampler's inputs for sample rows reading slots `row_slots` (i32[S]); `bitmask`
    (i32[S, ceil(V / 32)]): the structured-output masks, all ones for unconstrained rows.
    Speculative decoding: `drafts` (i32[S]) the draft token each row verifies (-1: none) and
    `offsets` (i32[S]) the row's place among its sequence's rows (its token's index past the
    slot's step count)."""
    p = state.params[row_slots]                                          # [S, NUM_PARAMS]
    steps = p[:, P_STEPS] if offsets is None else p[:, P_STEPS] + offsets
    f32 = lambda column: jax.lax.bitcast_convert_type(p[:, column], jnp.float32)  # noqa: E731
    return SamplingMetadata(
        temperature=f32(P_TEMPERATURE), top_k=p[:, P_TOP_K], top_p=f32(P_TOP_P), min_p=f32(P_MIN_P),
        presence_penalty=f32(P_PRESENCE), frequency_penalty=f32(P_FREQUENCY),
        repetition_penalty=f32(P_REPETITION), seeds=jax.lax.bitcast_convert_type(p[:, P_SEED], jnp.uint32),
        steps=steps, requested_logprobs=p[:, P_LOGPROBS], has_logit_bias=p[:, P_HAS_BIAS] != 0,
        output_counts=state.output_counts, prompt_mask=state.prompt_mask, logit_bias=state.logit_bias,
        all_greedy=False, num_logprobs=num_logprobs, rows=row_slots, min_tokens_ban=state.min_tokens_ban,
        ban_active=p[:, P_STEPS] < p[:, P_MIN_TOKENS], bitmask=bitmask, draft_tokens=drafts,
        custom=p[:, P_CUSTOM] != 0)


def emitted_rows(drafts: jax.Array, accepted: jax.Array, first: jax.Array) -> jax.Array:
    """Traced: bool[S], the rows whose token a request keeps: every row whose sequence's earlier
    rows (first[i] .. i - 1) all had their draft accepted (rows without a draft: always)."""
    rejected = ((drafts >= 0) & ~accepted).astype(jnp.int32)
    before = jnp.cumsum(rejected) - rejected            # rejections in rows 0 .. i - 1
    return before == before[first]


def count_sampled(state: SlotState, count_slots: jax.Array, tokens: jax.Array) -> SlotState:
    """Traced: add each sampled token to its slot's counts, step counter and (kept with custom logits
    processors, which rule out speculation: one row a slot) output tokens (slots out of bounds: rows that
    sampled nothing)."""
    outputs = state.output_tokens
    if outputs is not None:
        steps = state.params.at[count_slots, P_STEPS].get(mode="fill", fill_value=outputs.shape[1])
        outputs = outputs.at[count_slots, steps].set(tokens, mode="drop")
    return dataclasses.replace(
        state, output_counts=state.output_counts.at[count_slots, tokens].add(1, mode="drop"),
        params=state.params.at[count_slots, P_STEPS].add(1, mode="drop"), output_tokens=outputs)
