"""The persistent batch: the device builds the same batch the host builder does, from sparse
updates, and the sampler reads the same inputs from slots as from host-built metadata."""

import dataclasses
import random
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.core.request import Request
from jaxpaged.runner import persistent_batch as pb
from jaxpaged.runner import step_input as si
from jaxpaged.runner.batch_builder import SeqChunk, choose_shape
from tests.forward_batch import build_forward_batch
from jaxpaged.runner.sampler import sample
from jaxpaged.sampling_params import SamplingParams
from tests.runner.sampler_helpers import build_sampling_metadata

BS, MAX_BLOCKS, SLOTS, V = 4, 8, 6, 50


@jax.jit
def _device_batch(state, updates, fields):
    state = pb.apply_step_updates(state, updates)
    positions, slot_mapping, kv_lens, tables, *_ = si.forward_batch_arrays(fields, state.block_tables, BS,
                                                                          state.params)
    return state, positions, slot_mapping, kv_lens, tables


class _Seq:
    """A sequence growing by random chunks, its blocks from a shared counter."""

    def __init__(self, rng, next_block):
        self.request = Request(f"r{next_block[0]}", [1], SamplingParams(temperature=0.0))
        self.blocks, self.computed, self.rng, self.next_block = [], 0, rng, next_block

    def chunk(self) -> SeqChunk:
        n = self.rng.choice([1, 1, 3, 7])
        while len(self.blocks) * BS < self.computed + n:
            self.blocks.append(self.next_block[0])
            self.next_block[0] += 1
        if self.rng.random() < 0.2 and self.computed % BS:   # copy-on-write replaces the written block
            self.blocks[self.computed // BS] = self.next_block[0]
            self.next_block[0] += 1
        chunk = SeqChunk(list(range(100, 100 + n)), self.computed, list(self.blocks))
        self.computed += n
        return chunk


def test_device_batch_matches_the_host_builder_over_steps_with_slot_reuse():
    rng = random.Random(0)
    table = pb.SlotTable(SLOTS, V)
    state = pb.SlotState.zeros(SLOTS, MAX_BLOCKS, V)
    next_block = [1]
    live: list[_Seq] = []
    updates_sent = []
    for _ in range(40):
        # requests finish (their slots are taken by new ones, whose rows hold a stale tail)
        finished = [seq.request for seq in live if seq.computed > 20 or rng.random() < 0.1]
        live = [seq for seq in live if seq.request not in finished]
        while len(live) < 4:
            live.append(_Seq(rng, next_block))
        stepping = [s for s in live if rng.random() < 0.8] or live[:1]
        table.begin_step([], finished)   # as the plan names them
        chunks, slots = [], []
        for seq in stepping:
            start = seq.computed
            chunk = seq.chunk()
            slots.append(table.slot_for(seq.request))
            table.sync_blocks(slots[-1], chunk.block_ids, start // BS)
            chunks.append(chunk)
        shape = choose_shape(chunks, token_floor=16, seq_floor=4, max_seqs=SLOTS)
        layout = si.StepLayout(shape.num_tokens, shape.num_seqs)
        before, in_step = table.take_updates(layout.num_updates)
        assert before == []
        updates_sent.append(len(in_step))
        buffer, v = layout.empty(table.pad_slot)
        v["seq_slots"][:len(chunks)] = slots
        v["start_pos"][:len(chunks)] = [c.start_pos for c in chunks]
        v["cu_q_lens"][1:] = np.cumsum([len(c.token_ids) for c in chunks] + [0] * (shape.num_seqs - len(chunks)))
        total = int(v["cu_q_lens"][-1])
        v["input_ids"][:total] = [t for c in chunks for t in c.token_ids]
        pb.pack_updates(in_step, layout.num_updates, v["updates"])
        fields = layout.unpack(jnp.asarray(buffer))
        state, positions, slot_mapping, kv_lens, tables = _device_batch(state, fields["updates"], fields)
        want = build_forward_batch(chunks, BS, MAX_BLOCKS, shape)
        np.testing.assert_array_equal(positions, want.positions)
        np.testing.assert_array_equal(slot_mapping, want.slot_mapping)
        np.testing.assert_array_equal(kv_lens, want.attn.kv_lens)
        np.testing.assert_array_equal(tables, want.attn.block_tables)
        np.testing.assert_array_equal(fields["cu_q_lens"], want.attn.cu_q_lens)
    # after its first step a sequence sends only the blocks it appends or replaces
    assert max(updates_sent[1:]) < SLOTS * MAX_BLOCKS and sum(updates_sent) < 3 * next_block[0] + 40 * 4 * 12


def test_a_running_sequence_sends_nothing_until_it_needs_a_block():
    table = pb.SlotTable(SLOTS, V)
    request = Request("a", [1, 2, 3], SamplingParams(temperature=0.0))
    table.begin_step([])
    slot = table.slot_for(request)
    table.sync_blocks(slot, [7], 0)
    _, first = table.take_updates(1000)
    assert (pb.TABLE, slot, 0, 7) in first and sum(u[0] == pb.PARAM for u in first) == pb.NUM_PARAMS
    table.begin_step([])
    assert table.slot_for(request) == slot
    table.sync_blocks(slot, [7], 0)
    assert table.take_updates(1000) == ([], [])
    table.sync_blocks(slot, [7, 9], 1)
    assert table.take_updates(1000) == ([], [(pb.TABLE, slot, 1, 9)])
    # finished (the plan names it): the slot goes to the next request, rebuilt from scratch
    table.begin_step([], finished=[request])
    other = Request("b", [1], SamplingParams(temperature=0.0))
    assert table.slot_for(other) == slot
    table.sync_blocks(slot, [3], 0)
    assert (pb.TABLE, slot, 0, 3) in table.take_updates(1000)[1]


def test_a_freed_slot_goes_to_the_next_request_and_more_sequences_than_slots_raise():
    table = pb.SlotTable(2, V)
    a, b, c = (Request(x, [1], SamplingParams(temperature=0.0)) for x in "abc")
    table.begin_step([])
    sa, sb = table.slot_for(a), table.slot_for(b)
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        table.slot_for(c)                    # a and b hold both slots
    table.begin_step([], finished=[a])
    assert table.slot_for(b) == sb
    assert table.slot_for(c) == sa


def test_sampler_reads_the_same_inputs_from_slots_as_from_host_metadata():
    """Penalties (prompt and output tokens), logit_bias, min_tokens and seeded random rows: the
    tokens and logprobs equal those of host-built metadata with the same requests."""
    eos = (3,)
    specs = [
        dict(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.4),
        dict(temperature=0.9, seed=11, top_k=20, logit_bias={5: 4.0, 6: -2.0}),
        dict(temperature=0.0, min_tokens=5, stop_token_ids=[8, 9]),
        dict(temperature=0.7, top_p=0.8, seed=5, frequency_penalty=-0.5, logprobs=3),
        dict(temperature=0.0),
    ]
    rng = np.random.default_rng(0)
    requests = []
    for i, spec in enumerate(specs):
        prompt = rng.integers(0, V, 12).tolist()
        r = Request(f"q{i}", prompt, SamplingParams(max_tokens=50, **spec), eos_token_ids=eos, seed=1000 + i)
        for t in rng.integers(0, V, 4).tolist():
            r.append_output_token(t)
        requests.append(r)
    table = pb.SlotTable(SLOTS, V)
    state = pb.SlotState.zeros(SLOTS, MAX_BLOCKS, V)
    # a previous owner leaves counts, bias and a ban in slot 0: the new owners must not see them
    stale = Request("stale", [4, 4], SamplingParams(frequency_penalty=1.0, logit_bias={7: 9.0}, min_tokens=99,
                                                    max_tokens=100), eos_token_ids=(7,))
    stale.append_output_token(10)
    table.begin_step([])
    table.slot_for(stale)
    before, in_step = table.take_updates(0)
    state = pb.apply_updates(state, before + in_step)
    stale.status = types.SimpleNamespace(is_finished=True)
    table.begin_step([])
    slots = [table.slot_for(r) for r in requests]
    before, in_step = table.take_updates(0)
    state = pb.apply_updates(state, before + in_step)
    S = 8
    row_slots = np.full(S, table.pad_slot, np.int32)
    row_slots[:len(slots)] = slots
    logits = jnp.asarray(rng.normal(size=(S, V)) * 3, jnp.float32)
    got = jax.jit(lambda st, rs, lg: sample(lg, si.sampling_metadata(st, rs, 4)))(state, row_slots, logits)

    banned = [({t: float("-inf") for t in [8, 9, 3]} if r.sampling_params.min_tokens > r.num_sampled_tokens
               else None) for r in requests]
    md = build_sampling_metadata([r.sampling_params for r in requests], [r.seed for r in requests],
                                 [r.num_sampled_tokens for r in requests], [r.output_token_ids for r in requests],
                                 [r.prompt_token_ids for r in requests], banned, V, S)
    md = jax.tree.map(jnp.asarray, md)
    want = jax.jit(sample)(logits, dataclasses.replace(md, num_logprobs=4, all_greedy=False))
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6)
    np.testing.assert_array_equal(got.topk_ids[:4], want.topk_ids[:4])
    # the min_tokens row really was banned, the biased row really biased
    assert int(got.token_ids[2]) not in (3, 8, 9)

    # counting the sampled tokens on the device equals counting them on the host
    state = si.count_sampled(state, jnp.asarray(row_slots[:len(slots)].tolist() + [SLOTS + 1] * (S - len(slots))),
                             got.token_ids)
    for r, slot, token in zip(requests, slots, np.asarray(got.token_ids)):
        if r.sampling_params.frequency_penalty:
            want_counts = np.bincount(r.output_token_ids + [int(token)], minlength=V)
            np.testing.assert_array_equal(np.asarray(state.output_counts[slot]), want_counts)
        assert int(state.params[slot, pb.P_STEPS]) == r.num_sampled_tokens + 1
