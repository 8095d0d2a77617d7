"""A step's inputs as the host builds them from a plan (ModelRunner.prepare_inputs): the InputBatch,
and the columns of the chunks other than plain decodes, appended one chunk at a time (plain decodes
are written into the step's buffer as whole columns)."""

import dataclasses
import operator

import numpy as np

from jaxpaged.runner.batch_builder import BatchShape
from jaxpaged.runner.persistent_batch import SlotTable


@dataclasses.dataclass
class InputBatch:
    """One step's inputs as the host builds them from a plan: the packed buffer (StepLayout) and
    which request each sample row serves."""
    shape: BatchShape
    buffer: np.ndarray                                # i32[StepLayout.size]
    requests: list                                    # per sampled request (n > 1 forks too), its first sample row:
    rows: list[int]                                   #   the request and the row, in row order
    constrained: list[tuple[int, object]]             # (sample row, Request needing a host mask: a grammar...)
    spec_rows: list[tuple[str, int, int]]             # (request_id, first sample row, drafts verified)
    lp_rows: list[tuple[str, int, int, int]]          # (request_id, first flat token, count, start position)
    sampler_kind: str | None = None                   # the sampler the host picked (None: the step's cond picks)
    embeds: list = dataclasses.field(default_factory=list)   # (flat token index, rows): prompt embeddings
    prompt_chunks: list = dataclasses.field(default_factory=list)   # (Request, first flat token, count, start) of
    # the prompt tokens of each chunk other than a plain decode (recorded for a MEAN or CLS pooling runner)
    mrope: list = dataclasses.field(default_factory=list)    # (flat token index, i32[n, 3]): M-RoPE offsets


# column getters over a plan's plain decodes (and their requests): one C-level pass each
REQUEST = operator.attrgetter("request")
START = operator.attrgetter("start")
LORA_SLOT = operator.attrgetter("lora_slot")
NUM_PLACEHOLDERS = operator.attrgetter("num_placeholders")
HOST_MASKED = operator.attrgetter("needs_host_mask")


class GeneralColumns:
    """The columns of a step's chunks other than plain decodes, appended one chunk at a time, their
    flat tokens, sequences and sample rows numbered after `offset` plain decodes."""

    def __init__(self, offset: int, record_prompt_chunks: bool = False):
        self.offset = offset
        self.record_prompt_chunks = record_prompt_chunks   # a MEAN or CLS pooling runner reads every prompt token
        self.input_ids, self.start_pos, self.q_lens, self.seq_slots, self.seq_lora = [], [], [], [], []
        self.logits_at, self.row_slots, self.count_slots, self.row_draft, self.row_first = [], [], [], [], []
        self.requests, self.rows, self.constrained, self.spec_rows, self.lp_rows, self.lp_targets = [], [], [], [], [], []
        self.prev_index, self.prev_source = [], []   # (flat token index, prev's sample row): tokens prev samples
        self.chunk_rows = []                         # per chunk: its (first) sample row
        self.embeds = []                             # (flat token index, rows [n, hidden]): prompt embeddings
        self.mrope = []                              # (flat token index, Request.mrope_offsets rows [n, 3])
        self.prompt_chunks = []                      # (request, flat token, count, start): prompt tokens

    def add(self, chunk, slots: SlotTable, block_size: int, prev, one_token_queries: bool) -> None:
        request = chunk.request
        n, start, blocks = chunk.num_new_tokens, chunk.start, chunk.block_ids
        flat = self.offset + len(self.input_ids)
        slot = slots.slot_of.get(request)
        if slot is None:
            slot = slots.slot_for(request)
            slots.sync_blocks(slot, blocks, 0)
        else:
            slots.sync_blocks(slot, blocks, start // block_size)
        row = self.offset + len(self.logits_at)
        self.chunk_rows.append(row)
        d = chunk.num_drafts   # speculative decoding: the chunk ends with d draft tokens to verify
        drafts = request.spec_token_ids[:d]
        tokens = request.all_token_ids[start:start + n - d]
        if len(tokens) < n - d:   # the last token is a placeholder: the step in flight samples it
            source = prev.row_of().get(request) if prev is not None else None
            if d or len(tokens) != n - 1 or source is None:
                raise RuntimeError(f"{request}: {n - d - len(tokens)} input tokens are not known yet")
            self.prev_index.append(flat + n - 1)
            self.prev_source.append(source)
            tokens = tokens + [0]
        if start < request.embeds_end:   # prompt embeddings, images: the step takes these rows, not tokens
            for first, values in request.embed_ranges:
                lo, hi = max(start, first), min(start + n - d, first + len(values))
                if lo < hi:
                    self.embeds.append((flat + lo - start, values[lo - first:hi - first]))
                    tokens[lo - start:hi - start] = [-1] * (hi - lo)
        offsets = request.mrope_offsets   # M-RoPE (Qwen2-VL's images): the prompt's first tokens' offsets
        if offsets is not None and start < len(offsets):
            self.mrope.append((flat, offsets[start:start + n - d]))
        tokens = tokens + drafts
        if self.record_prompt_chunks and start < request.num_prompt_tokens:
            self.prompt_chunks.append((request, flat, min(n - d, request.num_prompt_tokens - start), start))
        if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
            count = min(n, request.num_prompt_tokens - 1 - start)
            self.lp_rows.append((request.request_id, flat, count, start))
            self.lp_targets.append((flat, request.all_token_ids[start + 1:start + 1 + count]))
        if chunk.samples:
            self.requests.append(request)
            self.rows.append(row)
            if request.needs_host_mask:
                self.constrained.append((row, request))
            if d:
                self.spec_rows.append((request.request_id, row, d))
        for j in range(d + 1):   # rows for the last known token and each draft
            self.logits_at.append(flat + n - 1 - d + j)
            self.row_slots.append(slot)
            self.count_slots.append(slot if chunk.samples else slots.no_slot)
            self.row_draft.append(drafts[j] if j < d else -1)
            self.row_first.append(row)
        self.input_ids += tokens
        # only decodes and verifications: each verified token is a query of its own (a decode step)
        queries = [(start + j, 1) for j in range(n)] if d and one_token_queries else [(start, n)]
        for position, length in queries:
            self.start_pos.append(position)
            self.q_lens.append(length)
            self.seq_slots.append(slot)
            self.seq_lora.append(request.lora_slot)

    def add_fork(self, child, slot: int, parent_row: int) -> None:
        """n > 1: a sibling sampling its first token from its parent's logits."""
        row = self.offset + len(self.logits_at)
        self.requests.append(child)
        self.rows.append(row)
        if child.needs_host_mask:
            self.constrained.append((row, child))
        self.row_draft.append(-1)
        self.row_first.append(row)
        self.logits_at.append(self.logits_at[parent_row - self.offset])
        self.row_slots.append(slot)
        self.count_slots.append(slot)
