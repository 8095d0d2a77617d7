"""The step's compiled programs: which exist, compiling them before the first request, and
picking them per step. ModelRunner inherits this; the programs read its weights, the KV pool's
description, the persistent batch and the shard plan.

    forward   one per shape bucket (`warmup_shapes`): decode-only steps for each sequence bucket,
              steps with a prompt chunk for each token bucket
    sampler   one per sample-row count (and kind of bucket); with `host_branches` (a GPU) in the
              three kinds of step.SAMPLER_KINDS, the host picking per step (`sampler_kind`); a
              `greedy_only` runner (a draft model's) compiles the "greedy" kind alone
    prompt    prompt logprobs from the forward's hidden states, one per bucket's token count, run
              only for steps that ask (none for a greedy_only runner)

`warmup` compiles every one at start-up (and runs the block moves' and slot updates' buckets
once), so nothing compiles while serving; a program missing later is compiled with a warning.
"""

import concurrent.futures
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpaged.runner.batch_builder import PREFILL_Q_TILE, BatchShape, bucket_sizes
from jaxpaged.runner.block_ops import warm_up_block_moves
from jaxpaged.runner.persistent_batch import warm_up_updates
from jaxpaged.runner.sampler import SamplerLayout, uses_bias_row, uses_output_tokens
from jaxpaged.runner.step_input import StepLayout
from jaxpaged.runner.step import (LOGIT_ROW_CHUNK, SAMPLER_KINDS, PromptStatics, SampleStatics, StepStatics,
                                  forward_fn, prompt_logprobs_fn, sample_fn)
from jaxpaged.sampling_params import GREEDY_EPS

logger = logging.getLogger(__name__)

TOKEN_FLOOR = 16      # the smallest token bucket of a step with a prompt chunk
SEQ_FLOOR = 4         # the smallest sequence bucket (of a decode-only step)
# Where the host picks a step's branches (step.py): XLA:GPU reads a conditional's predicate on the host,
# after everything queued before it, so a `lax.cond` in the step would keep the host from running ahead
# of the device. This costs three samplers per sample-row count (SAMPLER_KINDS; a prompt bucket's sampler
# then computes its padding rows' logits too, since skipping them takes a loop of run-time length, and so
# shares the decode bucket's); on a CPU the conditionals are cheap and those stay unneeded.
HOST_BRANCH_PLATFORMS = ("gpu",)


class CompiledStep:
    """The compiled-program half of ModelRunner (see the module docstring)."""

    def _init_programs(self) -> None:
        self._compiled = {}                 # BatchShape -> the forward compiled for it
        self._samplers = {}                 # (sample rows, skip_padding, kind) -> the sampler compiled for them
        self._prompt_fns = {}               # step tokens -> its prompt-logprobs executable
        self._prompt_fns_lock = threading.Lock()   # start-up compiles buckets in threads; two share a token count
        self._warmed_up = False             # warmup() ran: a later compile is a missing bucket

    def _executables(self, shape: BatchShape, kind: str | None = None):
        """The forward and sampler compiled for `shape` (compiling them first if start-up did not);
        `kind`: the sampler the host picked (host_branches; None there: the first of _sampler_kinds),
        None: the one that picks itself."""
        key = self._sampler_key(shape, kind)
        forward, sampler = self._compiled.get(shape), self._samplers.get(key)
        if forward is None or sampler is None:   # expected only without compile_on_startup
            log = logger.warning if self._warmed_up else logger.debug
            log("compiling a step variant not compiled at start-up: %s", shape)
            forward, _ = self.compile_step(shape, prompt_logprobs=False)   # compiled when a step asks
            sampler = self._samplers[key]
        return forward, sampler

    def _sampler_key(self, shape: BatchShape, kind: str | None = None) -> tuple[int, bool, str | None]:
        """What a sampler is compiled for: the sample-row count, whether padding rows are skipped (a
        prompt step's bucket is mostly padding; a decode bucket is at most half; not with host_branches),
        and its kind (host_branches: one of _sampler_kinds, None meaning the first; else None: it picks)."""
        if self.host_branches:
            return shape.num_logits, False, kind or self._sampler_kinds[0]
        # up to one chunk of rows, skipping computes them all too: the decode bucket's sampler serves
        return shape.num_logits, shape.q_tile != 1 and shape.num_logits > LOGIT_ROW_CHUNK, None

    @property
    def _sampler_kinds(self) -> tuple:
        """The sampler kinds compiled per sample-row count: with host_branches all of SAMPLER_KINDS
        ("general" first), or "greedy" alone for a greedy_only runner; else the one that picks itself."""
        if not self.host_branches:
            return (None,)
        return ("greedy",) if self.greedy_only else SAMPLER_KINDS

    def programs(self, shape: BatchShape) -> tuple:
        """(forward, [its samplers], prompt-logprobs program or None) compiled for `shape` (compiling
        them first if needed): what a step of that bucket may run (engine/memory.py sizes it)."""
        forward, _ = self.compile_step(shape)
        samplers = [self._samplers[self._sampler_key(shape, kind)] for kind in self._sampler_kinds]
        return forward, samplers, self._prompt_fns.get(shape.num_tokens)

    def _prompt_logprobs(self, shape: BatchShape, hidden: jax.Array, buffer: np.ndarray) -> jax.Array:
        """The prompt logprobs of a step that asks for some, from its hidden states
        (the program compiled for the step's token count, whatever its bucket)."""
        prompt_fn = self._prompt_fns.get(shape.num_tokens)
        if prompt_fn is None:   # expected only without compile_on_startup
            log = logger.warning if self._warmed_up else logger.debug
            log("compiling prompt logprobs not compiled at start-up: %s", shape)
            self.compile_step(shape)
            prompt_fn = self._prompt_fns[shape.num_tokens]
        offset, size = StepLayout.of(shape).fields["prompt_targets"]
        return prompt_fn(self.state, hidden, self.plan.put(buffer[offset:offset + size]))

    def compile_step(self, shape: BatchShape, prompt_logprobs: bool = True):
        """Compile (and keep) the forward for `shape` and, unless kept already, its sampler (with
        host_branches: a sampler of each of _sampler_kinds) and, with `prompt_logprobs`, its
        prompt-logprobs program (never for a greedy_only runner); returns the forward and the (first)
        sampler, as jax.stages.Compiled."""
        forward = self._compiled.get(shape)
        if forward is None:
            layout = StepLayout.of(shape)
            statics = StepStatics(self.graphdef, layout, shape.q_tile, self.block_size, self.plan)
            buffer = layout.empty(self.slot_table.pad_slot)[0]   # its shape only: nothing moves while compiling
            replicated = self.plan.array_sharding(P())
            embeds = None if not self.takes_prompt_embeds else jax.ShapeDtypeStruct(
                (shape.num_tokens, self.model_config.hidden_size), self.embeds_dtype, sharding=replicated)
            mrope = None if not self.takes_mrope else jax.ShapeDtypeStruct(
                (shape.num_tokens, 3), np.int32, sharding=replicated)
            args = (self.state, self.kv_pool_spec, self.slot_state,
                    jax.ShapeDtypeStruct(buffer.shape, buffer.dtype, sharding=replicated),
                    self._no_prev_tokens, embeds, mrope)
            forward = self._compiled[shape] = forward_fn.lower(statics, *args).compile(self.compiler_options)
        # the forward's outputs come replicated, like the bitmask (one device: no sharding is
        # declared, which would commit the executables' outputs and miss jit caches downstream)
        replicated = self.plan.array_sharding(P())

        def like(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)
        for kind in self._sampler_kinds:
            key = self._sampler_key(shape, kind)
            if key not in self._samplers:
                statics = SampleStatics(self.graphdef, key[1], self.max_logprobs, self.max_num_seqs, self.plan,
                                        key[2], SamplerLayout.for_platform(self.plan.local_device.platform),
                                        self.logprobs_mode, self.logits_processors)
                bitmask = like(jax.ShapeDtypeStruct((shape.num_logits, self.bitmask_words), jnp.int32))
                custom = None if self.logits_processors is None else jax.tree.map(like, self.logits_processors.spec())
                self._samplers[key] = sample_fn.lower(statics, self.state, self.slot_state,
                                                      jax.tree.map(like, forward.out_info[2]),
                                                      bitmask, custom).compile(self.compiler_options)
        # every bucket's token count: a step of one-token chunks (a decode shape) can hold a prompt's
        # last chunk too, when the token budget left it one token
        if prompt_logprobs and not self.greedy_only:
            with self._prompt_fns_lock:
                if shape.num_tokens not in self._prompt_fns:
                    statics = PromptStatics(self.graphdef, self.max_logprobs, self.plan)
                    targets = like(jax.ShapeDtypeStruct((shape.num_tokens,), jnp.int32))
                    self._prompt_fns[shape.num_tokens] = prompt_logprobs_fn.lower(
                        statics, self.state, like(forward.out_info[3]), targets).compile(self.compiler_options)
        return forward, self._samplers[self._sampler_key(shape)]

    def warmup_shapes(self) -> list[BatchShape]:
        """Every bucket a step can take: decode-only steps for each sequence bucket, and steps
        with a prompt chunk for each token bucket (choose_shape gives their sequence bucket)."""
        shapes = [BatchShape(s, s, s, 1) for s in bucket_sizes(SEQ_FLOOR, self.max_decode_seqs)]
        for t in bucket_sizes(TOKEN_FLOOR, self.max_num_batched_tokens):
            s = min(t, self.max_num_seqs)
            shapes.append(BatchShape(t, s, t if self.speculative else s, PREFILL_Q_TILE))
        return shapes

    def warmup(self, shapes: list[BatchShape], progress=None) -> None:
        """Compile the forward, the sampler and the prompt-logprobs program (compile_step) for every
        shape in `shapes` (nothing runs), and the block moves for every bucket (each runs once, moving
        nothing)."""
        # XLA compiles outside the GIL: a few threads use the host's cores (each variant alone is
        # mostly single-threaded). Shapes sharing a sampler: the first compiles it, the rest after it.
        todo = [shape for shape in shapes if shape not in self._compiled]
        firsts = list({self._sampler_key(shape): shape for shape in reversed(todo)}.values())
        for shape in shapes:   # the all-allowed bitmasks (and no prompt embeddings), made here (not in the threads)
            self._bitmask_arg(shape, None)
            self._embeds_arg(shape, None)
            self._mrope_arg(shape, None)
        for batch in (firsts, [shape for shape in todo if shape not in firsts]):
            with concurrent.futures.ThreadPoolExecutor(max(1, min(len(batch), os.cpu_count() or 1))) as pool:
                for _ in pool.map(self.compile_step, batch):
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.update(len(shapes) - len(todo))
        self._warmed_up = True
        self.kv_pool = warm_up_block_moves(self.kv_pool, bucket_sizes(4, self.max_moved_blocks),
                                           self.swap_space or self.host_cache)
        self.slot_state = warm_up_updates(self.slot_state, self.plan)
        if self.channel is not None:   # several hosts: the step inputs' broadcasts, up to the largest step's
            largest = max(max(StepLayout.of(s).size, s.num_logits * self.bitmask_words) for s in shapes)
            self.channel.warm_up(max(largest, self.tier_payload if self.host_cache else 0))   # and the tier's


def max_decode_queries(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int) -> int:
    """The largest decode step: a query per sequence, and with speculation one per draft too (their
    tokens within the budget, plus a row for each n > 1 fork sampling beside its parent)."""
    if not num_speculative_tokens:
        return max_num_seqs
    return min(max_num_batched_tokens + max_num_seqs, max_num_seqs * (num_speculative_tokens + 1))


def sampler_kind(requests) -> str:
    """The sampler a step's sampling requests need (host_branches; see step.SAMPLER_KINDS). Each
    test errs towards the more general kind, which is right for every row too: "greedy" only if
    every row is what sampler.is_plain_greedy calls plain (greedy in f32, no bias, allowed or bad
    words, penalties, logprobs, grammar, pending min_tokens or custom logits processor), "untruncated"
    only if no random row has top-k or top-p."""
    def greedy(p):   # as the device compares: in f32 (0.0, the usual greedy, decides at once)
        return p.temperature == 0.0 or np.float32(p.temperature) < np.float32(GREEDY_EPS)

    def plain(request):
        p = request.sampling_params
        return (greedy(p) and not uses_bias_row(request) and not uses_output_tokens(p) and not p.logprobs
                and not request.needs_host_mask and p.min_tokens <= request.num_sampled_tokens
                and not request.custom_logits)

    if all(plain(r) for r in requests):
        return "greedy"
    def truncates(p):   # top_p in f32 too: 1.0, the default, decides at once
        return not greedy(p) and (p.top_k > 0 or (p.top_p < 1.0 and np.float32(p.top_p) < 1.0))

    if any(truncates(r.sampling_params) for r in requests):
        return "general"
    return "untruncated"
