"""The model runner: a scheduler plan in, sampled tokens out, through the step's executables
(step.py: a forward, a sampler, and prompt logprobs for the steps that ask):

    forward(weights, kv_pool, slots, buffer, prev_tokens) -> (kv_pool, slots, rows, ...)
    sample(weights, slots, rows, bitmask)                 -> (slots, packed, tokens)
                                                 kv_pool and slots donated; rows stay on the device

`buffer` is one i32 vector holding every per-step input (StepLayout), so each step costs one
host->device copy; `slots` is the persistent batch (persistent_batch.py): block tables,
sampling parameters and penalty state kept on the device and changed by sparse updates.
`packed` is one f32 vector holding every per-step result (tokens and ranks bit-cast), so
each step costs exactly one device->host copy. `dispatch` returns as soon as the step is
queued (JAX dispatch is asynchronous) so the engine can do host work while it runs;
`fetch` blocks on that one copy.

Structured outputs: `dispatch` queues the forward and, when no sample row is constrained, the
sampler right behind it (with a resident all-ones bitmask: nothing more moves). A step with
constrained rows waits for `sample(pending)`: the engine first applies the previous step's
tokens to the rows' grammar matchers, so the host fills this step's bitmask while its forward
runs on the device.

Async scheduling: a step may be dispatched before the previous one is fetched. A request
whose last token is still on the device (a placeholder, see Request.num_placeholders)
takes it from the previous step's sampled tokens, inside the step.

The compiled step is a closed set, compiled at start-up (compiled_step.py, which ModelRunner
inherits, as it inherits the KV pool and sleep mode from device_memory.py); every sampling feature
changes input values, never the executable.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxpaged.core.kv_cache_manager import cdiv
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.parallel import POOL_SPEC
from jaxpaged.runner.batch_builder import BatchShape, next_bucket, shape_for
from jaxpaged.runner.block_ops import HostCacheSpace, HostSwapSpace
from jaxpaged.runner.compiled_step import (HOST_BRANCH_PLATFORMS, SAMPLER_KINDS, SEQ_FLOOR, TOKEN_FLOOR, CompiledStep,
                                           max_decode_queries, sampler_kind)
from jaxpaged.runner.device_memory import DeviceMemory
from jaxpaged.runner.multihost import OP_SAMPLE, OP_STEP, OP_STOP, OP_UPDATES, StepChannel, follow, is_multihost
from jaxpaged.runner.input_batch import (HOST_MASKED, LORA_SLOT, NUM_PLACEHOLDERS, REQUEST, START, GeneralColumns,
                                         InputBatch)
from jaxpaged.runner.persistent_batch import SlotState, SlotTable, apply_updates, pack_updates
from jaxpaged.runner.pooled_rows import PooledRows
from jaxpaged.runner.step_args import StepArgs
from jaxpaged.runner.step_input import StepLayout
from jaxpaged.runner.step_results import StepResult, unpack_prompt_logprobs
from jaxpaged.runner.structured_outputs import bitmask_words, step_bitmask
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.kernels import kv_pool_shape
from jaxpaged.kernels.layout import is_fp8

logger = logging.getLogger(__name__)

KV_CHUNK_BLOCKS = 8   # attention walks the context 8 blocks at a time


@dataclasses.dataclass
class _Pending:
    inputs: InputBatch
    sample_rows: object | None                        # SampleRows on the device until the sampler is queued
    prompt_packed: jax.Array | None                   # f32[T * (2 + 2K)]; None: no prompt logprobs asked
    num_logprobs: int
    packed: jax.Array | None = None                   # f32[S * (4 + 2K)], a row per sample row (step_results.py)
    tokens: jax.Array | None = None                   # i32[MAX_ROWS]: sampled tokens, for the next step
    pooled_rows: jax.Array | None = None              # [S, hidden]: a pooling runner's sample rows' hidden states
    _row_of: dict | None = None

    @property
    def shape(self) -> BatchShape:
        return self.inputs.shape

    @property
    def is_sampled(self) -> bool:
        return self.sample_rows is None

    def row_of(self) -> dict:
        """request -> the sample row of its first token in this step (requests sampling here; requests
        hash by identity)."""
        if self._row_of is None:
            self._row_of = dict(zip(self.inputs.requests, self.inputs.rows))
        return self._row_of


class ModelRunner(CompiledStep, DeviceMemory, StepArgs):
    def __init__(self, model, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_dtype=None, num_host_blocks: int = 0, host_cache_slots: int = 0,
                 max_logprobs: int = MAX_LOGPROBS, calculate_kv_scales: bool = False,
                 num_speculative_tokens: int = 0, compiler_options: dict | None = None,
                 greedy_only: bool = False, pooling: str | None = None, prompt_embeds: bool = False,
                 logprobs_mode: str = "raw_logprobs", logits_processors=None):
        self.model_config = model.config
        # custom logits processors (jaxpaged.logits_processor.LogitsProcessors; None: none): compiled into every
        # sampler, told of each request taking a slot, their state sent with a step's sampler
        self.logits_processors = logits_processors
        self.logprobs_mode = logprobs_mode   # vLLM's: what sampled tokens' logprobs hold (sampler.LOGPROBS_MODES)
        # enable_prompt_embeds: every forward takes a [T, hidden] input of prompt-embedding rows, read where
        # a token's id is -1 (sent only by steps that hold such tokens; zeros on the device otherwise)
        self.takes_prompt_embeds = prompt_embeds
        self.embeds_dtype = np.dtype(model.dtype)
        self._no_embeds = {}                # step tokens -> zeros [T, hidden] on the device
        # a Qwen2-VL engine that runs images: every forward takes M-RoPE offsets i32[T, 3] as well (sent only by
        # steps with a prompt token of a request with images; zeros on the device otherwise)
        self.takes_mrope = prompt_embeds and bool(model.config.mrope_section)
        self._no_mrope = {}                 # step tokens -> zeros [T, 3] on the device
        # runner="pooling" (its pooling_type): each step also brings back its sample rows' hidden states (a
        # prompt's last token's: LAST), or every token's (MEAN, CLS); their sampled tokens are not used
        self.pooler = PooledRows(self, pooling) if pooling else None
        # every request it runs samples plain greedy, without prompt logprobs (a draft model's runner):
        # no prompt-logprobs programs to compile, and with host_branches one sampler kind
        self.greedy_only = greedy_only
        self.compiler_options = compiler_options or None   # XLA options of the step's programs (optimization_level)
        self.graphdef, self.state = nnx.split(model)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # speculative decoding: a step verifying drafts has a sample row per token; one that only
        # decodes and verifies lays each draft out as a one-token query of its own (a decode step
        # with more rows, up to max_decode_seqs)
        self.speculative = num_speculative_tokens > 0
        self.max_decode_seqs = max_decode_queries(max_num_seqs, max_num_batched_tokens, num_speculative_tokens)
        self.plan = model.shard_plan   # its devices (tensor parallelism: the pool is sharded by KV heads)
        self.host_branches = self.plan.local_device.platform in HOST_BRANCH_PLATFORMS
        # a device with memory of its own: results start their copy to the host as soon as queued (a CPU's
        # are in host memory, and there the call would wait for the step: dispatch must not)
        self.copy_results_early = self.plan.local_device.platform != "cpu"
        blocks = cdiv(max_model_len, block_size)
        self.max_blocks_per_seq = cdiv(blocks, KV_CHUNK_BLOCKS) * KV_CHUNK_BLOCKS
        cfg = self.model_config
        dtype = kv_dtype or model.dtype
        # The pool's memory is taken at its first use (kv_pool), after start-up's compilations: XLA's
        # GPU autotuner times each matmul on copies of its operands while it compiles, and a pool
        # already holding the memory budget leaves it none (an H200 start-up runs out of memory
        # compiling its first step variant so). The steps compile against this description of it.
        self._kv_pool = None
        self.kv_pool_spec = jax.ShapeDtypeStruct(
            kv_pool_shape(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim), dtype,
            sharding=self.plan.array_sharding(POOL_SPEC) or SingleDeviceSharding(self.plan.local_device))
        # fp8 KV scales from the first step's tokens (vLLM's calculate_kv_scales): 0 = not yet calibrated
        self.calibrating_kv_scales = calculate_kv_scales and is_fp8(dtype)
        if self.calibrating_kv_scales:
            scales = self.state["kv_scales"]
            scales.set_value(self.plan.put(np.zeros(scales.get_value().shape, np.float32)))
        self.max_logprobs = max_logprobs   # K: every step returns this many top logprobs per row
        self.bitmask_words = bitmask_words(cfg.vocab_size)   # structured outputs: i32 words per mask row
        self._all_allowed = {}              # sample rows -> a device bitmask of all ones (no transfer per step)
        self.max_moved_blocks = next_bucket(self.max_blocks_per_seq, 4)   # per swap or copy call
        self._init_programs()               # the compiled step (compiled_step.py)
        # the persistent batch: one slot per sequence a step can hold
        self.slot_table = SlotTable(max_num_seqs, cfg.vocab_size, logits_processors)
        with jax.default_device(self.plan.local_device):   # built on this engine's first device here, then replicated
            self.slot_state = self.plan.replicate(SlotState.zeros(
                max_num_seqs, self.max_blocks_per_seq, cfg.vocab_size, max_model_len if logits_processors else 0))
            # every step returns its sampled tokens padded to max_num_seqs rows (its largest bucket)
            self._no_prev_tokens = self.plan.replicate(jnp.zeros(max_num_seqs, jnp.int32))
        self.swap_space = HostSwapSpace(self.kv_pool_spec, num_host_blocks) if num_host_blocks else None
        # the prefix cache's host tier (kv_offloading_size): its block slots, and their bytes
        self.host_cache_slots = host_cache_slots
        self.host_cache = HostCacheSpace(self.kv_pool_spec) if host_cache_slots else None
        # several hosts: rank 0 sends each device operation to the others (multihost.py)
        self.channel = StepChannel() if is_multihost() else None
        self.steps_run = 0                  # device steps launched (a follower counts the ones it ran)

    # ---- sizes -----------------------------------------------------------------------------
    @staticmethod
    def bytes_per_block(model_config, block_size: int, dtype) -> int:
        c = model_config
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * jnp.dtype(dtype).itemsize

    def run_without_step(self, plan: SchedulerOutput) -> None:
        """A plan with nothing to compute: its block moves, and the slots of requests it preempted
        (they take a fresh slot, parameters seeded anew, when they run again)."""
        self.slot_table.begin_step(plan.preempted, plan.finished)
        self.move_blocks(plan)
        self.load_host_blocks(plan)

    # ---- one step ----------------------------------------------------------------------------
    def dispatch(self, plan: SchedulerOutput, prev: _Pending | None = None) -> _Pending:
        """Queue the plan's step on the device; returns without waiting: block moves, the step's
        inputs (`prepare_inputs`), its forward (`execute_model`) and, unless a sample row is
        constrained, its sampler.

        `prev` is the step still in flight, if any: a request whose last token it is sampling
        (a placeholder) reads that token from prev's device output, inside this step (prev's
        sampler is queued first if it was not).

        With a constrained sample row (structured outputs) only the forward is queued: call
        `sample(pending)` once the rows' matchers have their previous tokens (fetch does, if not).
        """
        if prev is not None and not prev.is_sampled:
            self.sample(prev)
        self.move_blocks(plan)
        self.slot_table.begin_step(plan.preempted, plan.finished)
        inputs = self.prepare_inputs(plan, prev)
        pending = self.execute_model(inputs, prev)
        if not inputs.constrained:
            self.sample(pending)
        self.load_host_blocks(plan)
        return pending

    def prepare_inputs(self, plan: SchedulerOutput, prev: _Pending | None = None) -> InputBatch:
        """The step's input batch. The plan's plain decodes (its first `num_plain_decodes` chunks: one
        token each, blocks unchanged) are taken as columns, whole-array operations on the packed
        buffer; every other chunk (prompts, chunks, verifications, forks) in one pass appending to
        per-sequence and per-sample-row lists."""
        slots = self.slot_table
        k = plan.num_plain_decodes
        decodes = plan.chunks[:k]
        requests = list(map(REQUEST, decodes))
        decode_slots = list(map(slots.slot_of.get, requests))
        if None in decode_slots or slots.unsynced:   # a fresh slot (or a fork's, taken last step): its whole table
            for i, slot in enumerate(decode_slots):
                if slot is None:
                    slot = decode_slots[i] = slots.slot_for(requests[i])
                if slot in slots.unsynced:
                    slots.sync_blocks(slot, decodes[i].block_ids, 0)
        # the general chunks, after the decodes
        g = GeneralColumns(k, self.pooler is not None and self.pooler.every_token)
        one_token_queries = all(c.num_new_tokens - c.num_drafts == 1 for c in plan.chunks[k:])
        for chunk in plan.chunks[k:]:
            g.add(chunk, slots, self.block_size, prev, one_token_queries)
        for i, chunk in enumerate(plan.chunks[k:]):   # n > 1: siblings sample their first token from the same logits
            for child in chunk.forks:
                g.add_fork(child, slots.slot_for(child), g.chunk_rows[i])
        flat, num_seqs, num_rows = k + len(g.input_ids), k + len(g.q_lens), k + len(g.logits_at)
        shape = shape_for(flat, num_seqs, flat == num_seqs, TOKEN_FLOOR, SEQ_FLOOR, self.max_num_batched_tokens,
                          self.max_num_seqs, num_rows, self.speculative, self.max_decode_seqs)
        layout = StepLayout.of(shape)
        before, in_step = slots.take_updates(layout.num_updates)
        if before:   # requests with penalties, bias or min_tokens joined, or more updates than fit
            if self.channel is not None:
                self.channel.send(OP_UPDATES, (len(before),), np.asarray(before, np.int32))
            self.slot_state = apply_updates(self.slot_state, before, self.plan)
        buffer, v = layout.empty(slots.pad_slot)
        # the decodes: sequence i is sample row i, its token at flat index i
        num_prev = 0
        if k:
            v["start_pos"][:k] = list(map(START, decodes))
            v["seq_slots"][:k] = decode_slots
            v["row_slots"][:k] = v["seq_slots"][:k]
            v["count_slots"][:k] = v["seq_slots"][:k]
            v["seq_lora"][:k] = list(map(LORA_SLOT, requests))
            v["cu_q_lens"][1:k + 1] = np.arange(1, k + 1)
            v["logits_indices"][:k] = np.arange(k)
            waiting = np.fromiter(map(NUM_PLACEHOLDERS, requests), np.int32, k) > 0
            # a placeholder: the step in flight samples the input token; else the request's last token
            from_prev = np.flatnonzero(waiting)
            if len(from_prev):
                rows_of_prev = prev.row_of() if prev is not None else {}
                waiting_requests = requests if len(from_prev) == k else map(requests.__getitem__, from_prev.tolist())
                sources = list(map(rows_of_prev.get, waiting_requests))
                if None in sources:
                    raise RuntimeError(f"{requests[from_prev[sources.index(None)]]}: its input token is not known yet")
                num_prev = len(sources)
                v["prev_index"][:num_prev] = from_prev
                v["prev_source"][:num_prev] = sources
            if num_prev < k:
                known = np.flatnonzero(~waiting).tolist()
                v["input_ids"][known] = [requests[i].all_token_ids[decodes[i].start] for i in known]
        # then the general chunks
        v["input_ids"][k:flat] = g.input_ids
        for first, targets in g.lp_targets:
            v["prompt_targets"][first:first + len(targets)] = targets
        v["seq_slots"][k:num_seqs] = g.seq_slots
        v["seq_lora"][k:num_seqs] = g.seq_lora
        v["start_pos"][k:num_seqs] = g.start_pos
        np.cumsum(g.q_lens, out=v["cu_q_lens"][k + 1:num_seqs + 1])
        v["cu_q_lens"][k + 1:num_seqs + 1] += k
        v["cu_q_lens"][num_seqs + 1:] = flat
        v["logits_indices"][k:num_rows] = g.logits_at
        v["row_slots"][k:num_rows] = g.row_slots
        v["count_slots"][k:num_rows] = g.count_slots
        v["row_draft"][k:num_rows] = g.row_draft
        v["row_first"][k:num_rows] = g.row_first
        v["prev_index"][num_prev:num_prev + len(g.prev_index)] = g.prev_index
        v["prev_source"][num_prev:num_prev + len(g.prev_source)] = g.prev_source
        pack_updates(in_step, layout.num_updates, v["updates"])
        constrained = g.constrained
        if k and any(map(HOST_MASKED, requests)):   # structured outputs or bad words among the decodes
            constrained = [(i, r) for i, r in enumerate(requests) if r.needs_host_mask] + constrained
        requests += g.requests
        kind = None
        if self.host_branches:
            kind = sampler_kind(requests)
            if kind not in self._sampler_kinds:
                raise RuntimeError(f"this runner compiles only the {self._sampler_kinds} samplers (greedy_only); "
                                   f"its step needs the {kind!r} one")
        return InputBatch(shape, buffer, requests, list(range(k)) + g.rows, constrained, g.spec_rows, g.lp_rows, kind,
                          g.embeds, g.prompt_chunks, g.mrope)

    def execute_model(self, inputs: InputBatch, prev: _Pending | None = None) -> _Pending:
        """Queue the step's forward (its sampler waits for `sample`)."""
        shape = inputs.shape
        kind = inputs.sampler_kind
        if self.channel is not None:
            # an unconstrained step's sampler follows at once with the all-ones mask: no OP_SAMPLE
            self.channel.send(OP_STEP, (shape.num_tokens, shape.num_seqs, shape.num_logits, shape.q_tile,
                                        int(prev is not None), int(not inputs.constrained),
                                        -1 if kind is None else SAMPLER_KINDS.index(kind), int(bool(inputs.lp_rows))),
                              inputs.buffer)
        prev_tokens = prev.tokens if prev is not None else self._no_prev_tokens
        sample_rows, prompt_packed, hidden = self.run_forward(shape, inputs.buffer, prev_tokens,
                                                              bool(inputs.lp_rows), inputs.embeds, inputs.mrope)
        return _Pending(inputs, sample_rows, prompt_packed if inputs.lp_rows else None, self.max_logprobs,
                        pooled_rows=None if self.pooler is None else hidden if self.pooler.every_token
                        else sample_rows.hidden)

    def run_forward(self, shape: BatchShape, buffer: np.ndarray, prev_tokens: jax.Array,
                    prompt_logprobs: bool = False, embeds: list | None = None, mrope: list | None = None):
        """Launch the forward of a step (its inputs packed in `buffer`; `embeds` and `mrope`, InputBatch's);
        returns (sample rows, prompt logprobs, every token's hidden state), left on the device (prompt logprobs:
        None when the step asks none). The first step of an engine calibrating its fp8 KV scales (calculate_kv_scales)
        sets them for every later step."""
        forward, _ = self._executables(shape)
        self.kv_pool, self.slot_state, sample_rows, hidden, kv_scales = forward(
            self.state, self.kv_pool, self.slot_state, self.plan.put(buffer), prev_tokens,
            self._embeds_arg(shape, embeds), self._mrope_arg(shape, mrope))
        prompt_packed = self._prompt_logprobs(shape, hidden, buffer) if prompt_logprobs else None
        if self.calibrating_kv_scales:
            self.state["kv_scales"].set_value(kv_scales)
            self.calibrating_kv_scales = False
        self.steps_run += 1
        return sample_rows, prompt_packed, hidden

    def sample(self, pending: _Pending) -> None:
        """Queue the sampler of a dispatched step (no-op if queued). Its constrained rows' bitmask is
        filled now, from their matchers: each must have consumed every token before this step's.
        A row whose request finished meanwhile allows everything (its token is dropped)."""
        if pending.is_sampled:
            return
        constrained = pending.inputs.constrained
        bitmask = step_bitmask(constrained, pending.shape.num_logits, self.bitmask_words)
        if self.channel is not None and constrained:   # a held-back sampler: its mask goes along
            self.channel.send(OP_SAMPLE, (), bitmask)
        _, sampler = self._executables(pending.shape, pending.inputs.sampler_kind)
        custom = None if self.logits_processors is None else self.logits_processors.device_state(self.plan)
        self.slot_state, pending.packed, pending.tokens = sampler(
            self.state, self.slot_state, pending.sample_rows, self._bitmask_arg(pending.shape, bitmask), custom)
        pending.sample_rows = None
        # on an accelerator the device->host copy starts as soon as the step ends, not when fetch asks
        # (a CPU's arrays are in host memory already: there the call only waits for the step)
        if self.copy_results_early:
            for out in (pending.packed, pending.prompt_packed, pending.pooled_rows):
                if out is not None and out.is_fully_addressable:
                    out.copy_to_host_async()

    # ---- several hosts ----------------------------------------------------------------------
    def follow(self) -> int:
        """A follower rank's loop (multihost.follow): run rank 0's device operations until it stops;
        returns the number of steps run."""
        return follow(self)

    def stop_followers(self) -> None:
        """Rank 0: tell the other ranks to leave follow() (once; no-op on one host)."""
        if self.channel is not None and self.channel.is_leader and not self.channel.stopped:
            self.channel.send(OP_STOP)

    def fetch(self, pending: _Pending) -> StepResult:
        """Block on the step's device->host copy (two with prompt logprobs) and unpack it (its
        sampler is queued first if it was not)."""
        self.sample(pending)
        inputs = pending.inputs
        K = pending.num_logprobs
        prompt = unpack_prompt_logprobs(_to_host(pending.prompt_packed), inputs.lp_rows, K) if inputs.lp_rows else {}
        result = StepResult(inputs.requests, inputs.rows, _to_host(pending.packed), K, prompt, inputs.spec_rows)
        if pending.pooled_rows is not None and (inputs.rows or inputs.prompt_chunks):
            result.pooled = self.pooler.vectors(_to_host(pending.pooled_rows), inputs)
        return result


def _to_host(x: jax.Array) -> np.ndarray:
    """A replicated step output on the host (across hosts: this host's copy)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(x.addressable_data(0))
