"""The model runner: a scheduler plan in, sampled tokens out, through one jitted step.

    step(params, kv_pool, batch, sampling) -> (kv_pool, packed)     kv_pool donated

`packed` is one f32 vector holding every per-step result (tokens and ranks bit-cast), so
each step costs exactly one device->host copy. `dispatch` returns as soon as the step is
queued (JAX dispatch is asynchronous) so the engine can do host work while it runs;
`fetch` blocks on that one copy.

Async scheduling: a step may be dispatched before the previous one is fetched. A request
whose last token is still on the device (a placeholder, see Request.num_placeholders)
takes it from the previous step's `packed` output, on the device (`_take_prev_tokens`).
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.core.kv_cache_manager import cdiv
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.models.batch import ForwardBatch
from jaxpaged.runner.batch_builder import BatchShape, SeqChunk, build_forward_batch, choose_shape
from jaxpaged.runner.block_ops import HostSwapSpace, copy_blocks
from jaxpaged.runner.sampler import (SamplingMetadata, build_sampling_metadata, greedy_from_transposed,
                                     is_plain_greedy, sample, token_logprobs)
from pallas_kernels import kv_pool_shape

logger = logging.getLogger(__name__)

KV_CHUNK_BLOCKS = 8   # attention walks the context 8 blocks at a time


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclasses.dataclass
class PromptLogprobs:
    """For prompt tokens start+1 .. start+n of one request: logprob, rank and top-k each."""
    start: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclasses.dataclass
class StepResult:
    sampled: dict[str, SampledToken]
    prompt_logprobs: dict[str, PromptLogprobs]


@dataclasses.dataclass
class _Pending:
    packed: jax.Array
    rows: list[tuple[str, int]]                       # (request_id, sample row)
    lp_rows: list[tuple[str, int, int, int]]          # (request_id, first logits row, count, start position)
    num_seqs: int
    num_logits: int
    num_logprobs: int
    prompt_k: int


def _pack(*arrays: jax.Array) -> jax.Array:
    parts = []
    for a in arrays:
        a = a.reshape(a.shape[0], -1) if a.ndim > 1 else a[:, None]
        if jnp.issubdtype(a.dtype, jnp.integer):
            a = jax.lax.bitcast_convert_type(a.astype(jnp.int32), jnp.float32)
        parts.append(a.astype(jnp.float32))
    return jnp.concatenate(parts, axis=1).reshape(-1)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_dtype=None, num_host_blocks: int = 0):
        self.model_config = model.config
        self.graphdef, self.state = nnx.split(model)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        blocks = cdiv(max_model_len, block_size)
        self.max_blocks_per_seq = cdiv(blocks, KV_CHUNK_BLOCKS) * KV_CHUNK_BLOCKS
        cfg = self.model_config
        dtype = kv_dtype or model.embed[...].dtype
        self.kv_pool = jnp.zeros(kv_pool_shape(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                               cfg.head_dim), dtype)
        self._step = functools.partial(_step, self.graphdef)
        self.swap_space = HostSwapSpace(self.kv_pool, num_host_blocks) if num_host_blocks else None

    # ---- sizes -----------------------------------------------------------------------------
    @staticmethod
    def bytes_per_block(model_config, block_size: int, dtype) -> int:
        c = model_config
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * jnp.dtype(dtype).itemsize

    def move_blocks(self, plan: SchedulerOutput) -> None:
        """Swap-outs, swap-ins, then copy-on-write copies: all before the step reads the pool."""
        if plan.swap_out:
            self.swap_space.swap_out(self.kv_pool, plan.swap_out)
        if plan.swap_in:
            self.kv_pool = self.swap_space.swap_in(self.kv_pool, plan.swap_in)
        if plan.copies:
            self.kv_pool = copy_blocks(self.kv_pool, plan.copies)

    # ---- one step ----------------------------------------------------------------------------
    def dispatch(self, plan: SchedulerOutput, extra_bias: dict[str, dict[int, float]],
                 prev: _Pending | None = None) -> _Pending:
        """Build the inputs and queue the step on the device; returns without waiting.

        `prev` is the step still in flight, if any: a request whose last token it is sampling
        (a placeholder) reads that token from prev's device output.
        """
        self.move_blocks(plan)
        prev_rows = dict(prev.rows) if prev is not None else {}
        from_prev = []      # (flat token index, sample row of prev)
        flat = 0
        chunks, rows, lp_rows = [], [], []
        sample_rows = []
        row_requests = []   # the request whose params/seed drive each sample row
        lp_targets = []     # (first logits row, the prompt tokens those rows predict)
        prompt_k = -1
        row = 0
        for chunk in plan.chunks:
            request = chunk.request
            params = request.sampling_params
            wants_lp = params.prompt_logprobs is not None and chunk.start < request.num_prompt_tokens - 1
            n = chunk.num_new_tokens
            tokens = request.all_token_ids[chunk.start:chunk.start + n]
            if len(tokens) < n:   # the last token is a placeholder: the step in flight samples it
                if len(tokens) != n - 1 or request.request_id not in prev_rows:
                    raise RuntimeError(f"{request}: {n - len(tokens)} input tokens are not known yet")
                from_prev.append((flat + n - 1, prev_rows[request.request_id]))
                tokens = tokens + [0]
            flat += n
            if wants_lp:
                positions = list(range(n))
                count = min(n, request.num_prompt_tokens - 1 - chunk.start)
                lp_rows.append((request.request_id, row, count, chunk.start))
                lp_targets.append((row, request.all_token_ids[chunk.start + 1:chunk.start + 1 + count]))
                prompt_k = max(prompt_k, params.prompt_logprobs)
            else:
                positions = [n - 1] if chunk.samples else []
            if chunk.samples:
                rows.append((request.request_id, len(sample_rows)))
            sample_rows.append(row + len(positions) - 1 if positions else 0)
            row_requests.append(request)
            row += len(positions)
            chunks.append(SeqChunk(tokens, chunk.start, chunk.block_ids, positions))
        for i, chunk in enumerate(plan.chunks):   # n > 1: siblings sample their first token from the same logits
            if chunk.samples:
                for child in chunk.request.pending_forks:
                    rows.append((child.request_id, len(sample_rows)))
                    sample_rows.append(sample_rows[i])
                    row_requests.append(child)
        shape = choose_shape(chunks, token_floor=16, seq_floor=4, max_tokens=self.max_num_batched_tokens,
                             max_seqs=self.max_num_seqs, num_sample_rows=len(sample_rows))
        batch = build_forward_batch(chunks, self.block_size, self.max_blocks_per_seq, shape)
        sample_rows_arr = np.zeros(shape.num_seqs, np.int32)
        sample_rows_arr[:len(sample_rows)] = sample_rows
        smd = build_sampling_metadata(
            [r.sampling_params for r in row_requests], [r.seed for r in row_requests],
            [r.num_sampled_tokens for r in row_requests], [r.output_token_ids for r in row_requests],
            [r.prompt_token_ids for r in row_requests], [extra_bias.get(r.request_id) for r in row_requests],
            self.model_config.vocab_size, shape.num_seqs)
        targets = np.zeros(shape.num_logits, np.int32)
        for first, tokens in lp_targets:
            targets[first:first + len(tokens)] = tokens
        if from_prev:
            index = np.full(shape.num_seqs, shape.num_tokens, np.int32)   # padding: out of bounds, dropped
            source = np.zeros(shape.num_seqs, np.int32)
            index[:len(from_prev)], source[:len(from_prev)] = zip(*from_prev)
            batch = dataclasses.replace(batch, input_ids=_take_prev_tokens(
                batch.input_ids, prev.packed, jnp.asarray(index), jnp.asarray(source),
                num_seqs=prev.num_seqs, width=3 + 2 * prev.num_logprobs))
        self.kv_pool, packed = self._step(self.state, self.kv_pool, batch, jnp.asarray(sample_rows_arr), smd,
                                          jnp.asarray(targets), prompt_k=prompt_k)
        return _Pending(packed, rows, lp_rows, shape.num_seqs, shape.num_logits, smd.num_logprobs,
                        max(prompt_k, 0))

    def fetch(self, pending: _Pending) -> StepResult:
        """Block on the step's single device->host copy and unpack it."""
        flat = np.asarray(jax.device_get(pending.packed))
        S, K = pending.num_seqs, pending.num_logprobs
        width = 3 + 2 * K
        main = flat[:S * width].reshape(S, width)
        as_int = lambda a: a.view(np.int32)  # noqa: E731
        sampled = {}
        for request_id, r in pending.rows:
            sampled[request_id] = SampledToken(
                int(as_int(main[r, 0:1])[0]), float(main[r, 1]), int(as_int(main[r, 2:3])[0]),
                as_int(main[r, 3:3 + K]).tolist(), main[r, 3 + K:3 + 2 * K].tolist())
        prompt = {}
        if pending.lp_rows:
            Kp = pending.prompt_k
            pwidth = 2 + 2 * Kp
            lp = flat[S * width:].reshape(pending.num_logits, pwidth)
            for request_id, first, count, start in pending.lp_rows:
                block = lp[first:first + count]
                prompt[request_id] = PromptLogprobs(
                    start, block[:, 0].tolist(), as_int(np.ascontiguousarray(block[:, 1])).tolist(),
                    as_int(np.ascontiguousarray(block[:, 2:2 + Kp])).tolist(), block[:, 2 + Kp:].tolist())
        return StepResult(sampled, prompt)

    # ---- start-up compilation ---------------------------------------------------------------
    def warmup_shapes(self) -> list[BatchShape]:
        """Decode shapes for every sequence bucket and prefill shapes for every token bucket."""
        shapes = []
        s = 4
        while True:
            shapes.append(BatchShape(s, s, s, 1))
            if s >= self.max_num_seqs:
                break
            s = min(s * 2, self.max_num_seqs)
        t = 16
        while True:
            shapes.append(BatchShape(t, 4, 4, 16))
            if t >= self.max_num_batched_tokens:
                break
            t = min(t * 2, self.max_num_batched_tokens)
        return shapes

    def warmup(self, shapes: list[BatchShape], progress=None) -> None:
        """Compile the step for `shapes` (greedy sampling) by running it on an all-padding batch."""
        from types import SimpleNamespace
        greedy = SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
                                 frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, logprobs=None)
        for shape in shapes:
            batch = build_forward_batch([], self.block_size, self.max_blocks_per_seq, shape)
            smd = build_sampling_metadata([greedy], [0], [0], [[]], [[]], [None],
                                          self.model_config.vocab_size, shape.num_seqs)
            self.kv_pool, packed = self._step(self.state, self.kv_pool, batch,
                                              jnp.zeros(shape.num_seqs, jnp.int32), smd,
                                              jnp.zeros(shape.num_logits, jnp.int32), prompt_k=-1)
            packed.block_until_ready()
            if progress is not None:
                progress.update(1)


@functools.partial(jax.jit, static_argnames=("num_seqs", "width"))
def _take_prev_tokens(input_ids, prev_packed, index, source, *, num_seqs: int, width: int):
    """input_ids with input_ids[index[i]] = the token sampled in row source[i] of the previous step."""
    prev_tokens = jax.lax.bitcast_convert_type(prev_packed[:num_seqs * width].reshape(num_seqs, width)[:, 0],
                                               jnp.int32)
    return input_ids.at[index].set(prev_tokens[source], mode="drop")


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("prompt_k",), donate_argnums=(2,))
def _step(graphdef, state, kv_pool, batch: ForwardBatch, sample_rows, smd: SamplingMetadata,
               prompt_targets, *, prompt_k: int):
    model = nnx.merge(graphdef, state)
    kv_pool, hidden = model.hidden_states(kv_pool, batch)
    if is_plain_greedy(smd) and prompt_k < 0:   # the common decode case, in the CPU-friendly layout
        out = greedy_from_transposed(model.compute_logits_transposed(hidden[batch.logits_indices][sample_rows]))
        return kv_pool, _pack(out.token_ids, out.logprobs, out.ranks, out.topk_ids, out.topk_logprobs)
    logits = model.compute_logits(hidden[batch.logits_indices])       # f32[num_logits, vocab]
    out = sample(logits[sample_rows], smd)
    packed = [_pack(out.token_ids, out.logprobs, out.ranks, out.topk_ids, out.topk_logprobs)]
    if prompt_k >= 0:
        lp, rank, top_ids, top_lps = token_logprobs(logits, prompt_targets, prompt_k)
        packed.append(_pack(lp, rank, top_ids, top_lps))
    return kv_pool, jnp.concatenate(packed)
