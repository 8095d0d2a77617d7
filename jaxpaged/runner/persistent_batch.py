"""The persistent batch: per-request state kept on the device across steps (vLLM V1's
InputBatch), changed by sparse updates (the step's own packed input, which carries some of them:
step_input.py).

Each running request holds a *slot* (a row of every state array) from its first step until it
finishes or is preempted (the plan that follows names it: SchedulerOutput.finished, .preempted);
it then gets a fresh slot, rebuilt from the host, when it runs again.

    block_tables    i32[R + 1, max_blocks_per_seq]   a request's blocks; grows by appended blocks
    params          i32[R + 1, NUM_PARAMS]           sampling parameters (floats bit-cast), step count,
                                                     the request's rope length (ForwardBatch.rope_lens),
                                                     M-RoPE delta (Request.mrope_delta) and whether a custom
                                                     logits processor claimed it (jaxpaged.logits_processor)
    output_counts   i32[R + 1, V]                    tokens sampled so far (penalties)
    prompt_mask     bool[R + 1, V]                   tokens of the prompt (repetition penalty)
    logit_bias      f32[R + 1, V]                    the request's logit_bias, allowed_token_ids (-inf
                                                     elsewhere) and bad words of one token (-inf)
    min_tokens_ban  bool[R + 1, V]                   EOS and stop tokens, masked until min_tokens
    output_tokens   i32[R + 1, max_model_len]        the tokens sampled so far (only with custom logits
                                                     processors, which read them; else None)

Row R is padding: a greedy request with no blocks (padding sample rows read it). The host only
sends what changed, as (kind, slot, index, value) updates: TABLE for each block a sequence
appends (or a copy-on-write replaces), PARAM for the parameters of a request taking a slot;
RESET, PROMPT, COUNT, BIAS and BAN fill the [R + 1, V] rows of a request that uses
penalties, logit_bias or min_tokens when it takes its slot, OUTPUT its output_tokens row (a request coming
back after preemption). The step applies TABLE and PARAM
updates itself (they ride in its packed input); the [.., V] seeding, and updates past the
step's capacity, go through `apply_updates` before the step. The step counts the tokens it
samples into output_counts and the step counter.
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.parallel import ShardPlan
from jaxpaged.runner.sampler import uses_output_tokens

# params columns
(P_TEMPERATURE, P_TOP_K, P_TOP_P, P_MIN_P, P_PRESENCE, P_FREQUENCY, P_REPETITION, P_SEED, P_STEPS,
 P_LOGPROBS, P_HAS_BIAS, P_MIN_TOKENS, P_ROPE_LEN, P_MROPE_DELTA, P_CUSTOM) = range(15)
NUM_PARAMS = 15
FLOAT_PARAMS = (P_TEMPERATURE, P_TOP_P, P_MIN_P, P_PRESENCE, P_FREQUENCY, P_REPETITION)

# update kinds
TABLE, PARAM, RESET, PROMPT, COUNT, BIAS, BAN, OUTPUT = range(8)
STEP_KINDS = (TABLE, PARAM)           # the step applies these itself
UPDATE_WIDTH = 4                      # (kind, slot, index, value)
UPDATES_PER_CALL = 4096               # capacity of one apply_updates call
RESETS_PER_CALL = 8                   # rows one apply_updates call may clear


_F32_MAX = float(np.finfo(np.float32).max)


def _f32_bits(x: float) -> int:
    """The bits of x as a float32; a finite x past float32's range (temperature=1e39) is its largest."""
    return int(np.float32(min(max(x, -_F32_MAX), _F32_MAX) if np.isfinite(x) else x).view(np.int32))


def seeded_bias(params, banned_token_ids=()) -> dict[int, float]:
    """The entries of a request's logit_bias row (its other entries are 0, or -inf where it has
    allowed_token_ids): logit_bias on the allowed tokens, -inf on the banned ones (bad words of one
    token), as vLLM applies allowed_token_ids, then bad words, then logit_bias."""
    bias = params.logit_bias or {}
    if params.allowed_token_ids:
        bias = {int(t): bias.get(int(t), 0.0) for t in params.allowed_token_ids}
    return {**bias, **{int(t): -np.inf for t in banned_token_ids}}


def default_params() -> np.ndarray:
    """i32[NUM_PARAMS]: a greedy request with nothing else set (the padding row)."""
    row = np.zeros(NUM_PARAMS, np.int32)
    for column, value in ((P_TOP_P, 1.0), (P_REPETITION, 1.0)):
        row[column] = _f32_bits(value)
    return row


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    block_tables: jax.Array     # i32[R + 1, max_blocks_per_seq]
    params: jax.Array           # i32[R + 1, NUM_PARAMS]
    output_counts: jax.Array    # i32[R + 1, V]
    prompt_mask: jax.Array      # bool[R + 1, V]
    logit_bias: jax.Array       # f32[R + 1, V]
    min_tokens_ban: jax.Array   # bool[R + 1, V]
    output_tokens: jax.Array | None = None   # i32[R + 1, max_model_len]; None: not kept

    @classmethod
    def zeros(cls, num_slots: int, max_blocks_per_seq: int, vocab_size: int, output_len: int = 0) -> "SlotState":
        """output_len: the output_tokens rows' length (0: not kept)."""
        rows = num_slots + 1
        return cls(jnp.zeros((rows, max_blocks_per_seq), jnp.int32),
                   jnp.asarray(np.tile(default_params(), (rows, 1))),
                   jnp.zeros((rows, vocab_size), jnp.int32), jnp.zeros((rows, vocab_size), bool),
                   jnp.zeros((rows, vocab_size), jnp.float32), jnp.zeros((rows, vocab_size), bool),
                   jnp.zeros((rows, output_len), jnp.int32) if output_len else None)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


def _by_kind(updates, kind, num_rows):
    """The updates' (row, index, value), rows of other kinds out of bounds (dropped by scatters)."""
    rows = jnp.where(updates[:, 0] == kind, updates[:, 1], num_rows)
    return rows, updates[:, 2], updates[:, 3]


def apply_step_updates(state: SlotState, updates: jax.Array) -> SlotState:
    """TABLE and PARAM updates (i32[U, 4]; other kinds and padding are ignored). Traced."""
    R1 = state.params.shape[0]
    rows, index, value = _by_kind(updates, TABLE, R1)
    tables = state.block_tables.at[rows, index].set(value, mode="drop")
    rows, index, value = _by_kind(updates, PARAM, R1)
    params = state.params.at[rows, index].set(value, mode="drop")
    return dataclasses.replace(state, block_tables=tables, params=params)


@functools.partial(jax.jit, donate_argnums=(0,))
def _apply_updates(state: SlotState, updates: jax.Array) -> SlotState:
    R1 = state.params.shape[0]
    # at most RESETS_PER_CALL rows are cleared (the host splits calls so), before any other update
    (reset_at,) = jnp.nonzero(updates[:, 0] == RESET, size=RESETS_PER_CALL, fill_value=updates.shape[0])
    reset_rows = jnp.concatenate([updates[:, 1], jnp.array([R1], jnp.int32)])[reset_at]
    # a reset's value: the f32 bits of the bias its row starts from (-inf where allowed_token_ids is set)
    base_bias = jax.lax.bitcast_convert_type(jnp.concatenate([updates[:, 3], jnp.zeros((1,), jnp.int32)])[reset_at],
                                             jnp.float32)
    state = dataclasses.replace(
        state, output_counts=state.output_counts.at[reset_rows].set(0, mode="drop"),
        prompt_mask=state.prompt_mask.at[reset_rows].set(False, mode="drop"),
        logit_bias=state.logit_bias.at[reset_rows].set(base_bias[:, None], mode="drop"),
        min_tokens_ban=state.min_tokens_ban.at[reset_rows].set(False, mode="drop"))
    state = apply_step_updates(state, updates)
    rows, index, value = _by_kind(updates, PROMPT, R1)
    prompt_mask = state.prompt_mask.at[rows, index].set(True, mode="drop")
    rows, index, value = _by_kind(updates, COUNT, R1)
    counts = state.output_counts.at[rows, index].add(value, mode="drop")
    rows, index, value = _by_kind(updates, BIAS, R1)
    bias = state.logit_bias.at[rows, index].set(jax.lax.bitcast_convert_type(value, jnp.float32), mode="drop")
    rows, index, value = _by_kind(updates, BAN, R1)
    ban = state.min_tokens_ban.at[rows, index].set(True, mode="drop")
    outputs = state.output_tokens
    if outputs is not None:
        rows, index, value = _by_kind(updates, OUTPUT, R1)
        outputs = outputs.at[rows, index].set(value, mode="drop")
    return dataclasses.replace(state, output_counts=counts, prompt_mask=prompt_mask, logit_bias=bias,
                               min_tokens_ban=ban, output_tokens=outputs)


def apply_updates(state: SlotState, updates: list[tuple[int, int, int, int]], plan: ShardPlan = ShardPlan()
                  ) -> SlotState:
    """Every kind of update, in order, in calls of a fixed size (one compiled shape); state donated.
    `plan`: the devices the state is replicated on."""
    start = 0
    while start < len(updates):
        end, resets = start, 0
        while end < len(updates) and end - start < UPDATES_PER_CALL:
            if updates[end][0] == RESET:
                if resets == RESETS_PER_CALL:
                    break
                resets += 1
            end += 1
        state = _apply_updates(state, plan.put(pack_updates(updates[start:end], UPDATES_PER_CALL)))
        start = end
    return state


def warm_up_updates(state: SlotState, plan: ShardPlan = ShardPlan()) -> SlotState:
    """Compile apply_updates by running it once with nothing to do."""
    return _apply_updates(state, plan.put(pack_updates([], UPDATES_PER_CALL)))


def pack_updates(updates: list, capacity: int, out: np.ndarray | None = None) -> np.ndarray:
    """i32[capacity, 4]; padding entries have kind -1."""
    out = np.empty((capacity, UPDATE_WIDTH), np.int32) if out is None else out
    out[:] = -1
    if updates:
        out[:len(updates)] = updates
    return out


class SlotTable:
    """Host side of the persistent batch: which request holds which slot, what its device block
    table row holds, and the updates the next step must apply."""

    def __init__(self, num_slots: int, vocab_size: int, logits_processors=None):
        self.num_slots = num_slots
        # jaxpaged.logits_processor.LogitsProcessors, or None; with them the slots keep their output tokens
        self.logits_processors = logits_processors
        self.pad_slot = num_slots          # the padding row
        self.no_slot = num_slots + 1       # out of bounds: a row whose token is not counted
        self.vocab_size = vocab_size
        self.slot_of: dict[object, int] = {}           # Request (by identity) -> slot
        self._owner: list = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]   # mirror of block_tables rows
        self.unsynced: set[int] = set()   # slots taken whose block table row is not written yet (n > 1 forks)
        self.step_updates: list[tuple[int, int, int, int]] = []   # TABLE / PARAM, for the step
        self.seed_updates: list[tuple[int, int, int, int]] = []   # the rest, for apply_updates

    def begin_step(self, preempted, finished=()) -> None:
        """Free the slots of requests finished or preempted since the last step (changes state)."""
        for request in preempted:
            self.release(request)
        for request in finished:
            self.release(request)

    def release(self, request) -> None:
        slot = self.slot_of.pop(request, None)
        if slot is not None:
            self._owner[slot] = None
            self._free.append(slot)

    def slot_for(self, request) -> int:
        """The request's slot, taken (and its parameters queued) if it has none."""
        slot = self.slot_of.get(request)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"more than {self.num_slots} sequences (max_num_seqs) hold a slot")
            slot = self._free.pop()
            self._owner[slot] = request
            self.slot_of[request] = slot
            self.tables[slot] = []
            self.unsynced.add(slot)
            self._seed(slot, request)
        return slot

    def sync_blocks(self, slot: int, block_ids: list[int], first_written: int) -> None:
        """Queue TABLE updates for the blocks that changed: those from the block this step writes
        first (earlier ones never change while a slot is held), or all of them in a new slot."""
        mirror = self.tables[slot]
        self.unsynced.discard(slot)
        del mirror[len(block_ids):]
        for j in range(min(first_written, len(mirror)), len(block_ids)):
            block = block_ids[j]
            if j < len(mirror):
                if mirror[j] == block:
                    continue
                mirror[j] = block
            else:
                mirror.append(block)
            self.step_updates.append((TABLE, slot, j, block))

    def _seed(self, slot: int, request) -> None:
        p = request.sampling_params
        banned = []
        if p.min_tokens > request.num_sampled_tokens:
            banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(request.eos_token_ids))
        bias = seeded_bias(p, request.banned_token_ids)
        row = default_params()
        row[P_TEMPERATURE] = _f32_bits(p.temperature)
        row[P_TOP_K] = min(max(p.top_k, 0), np.iinfo(np.int32).max)   # past the vocabulary: all kept
        row[P_TOP_P] = _f32_bits(p.top_p)
        row[P_MIN_P] = _f32_bits(p.min_p)
        row[P_PRESENCE] = _f32_bits(p.presence_penalty)
        row[P_FREQUENCY] = _f32_bits(p.frequency_penalty)
        row[P_REPETITION] = _f32_bits(p.repetition_penalty)
        row[P_SEED] = np.uint32(int(request.seed) & 0xFFFFFFFF).view(np.int32)
        row[P_STEPS] = request.num_sampled_tokens
        row[P_LOGPROBS] = self.vocab_size if p.logprobs == -1 else (p.logprobs or 0)
        row[P_HAS_BIAS] = int(bool(bias))
        row[P_MIN_TOKENS] = p.min_tokens if banned else 0
        row[P_ROPE_LEN] = request.rope_len
        row[P_MROPE_DELTA] = request.mrope_delta
        if self.logits_processors is not None:   # a claimed request never samples plain greedy
            request.custom_logits = self.logits_processors.add_request(slot, p)
            row[P_CUSTOM] = int(request.custom_logits)
            self.seed_updates += [(OUTPUT, slot, i, t) for i, t in enumerate(request.output_token_ids)]
        self.step_updates += [(PARAM, slot, i, int(v)) for i, v in enumerate(row)]
        penalised = uses_output_tokens(p)
        if not (penalised or bias or banned):
            return   # the step never reads this slot's [.., V] rows
        seed = self.seed_updates
        seed.append((RESET, slot, 0, _f32_bits(-np.inf if p.allowed_token_ids else 0.0)))
        if penalised:
            if not request.num_embeds_tokens:   # a prompt of embeddings has no tokens to penalise
                seed += [(PROMPT, slot, t, 1) for t in set(request.prompt_token_ids)]
            seed += [(COUNT, slot, t, n) for t, n in collections.Counter(request.output_token_ids).items()]
        seed += [(BIAS, slot, int(t), _f32_bits(v)) for t, v in bias.items()]
        seed += [(BAN, slot, int(t), 1) for t in set(banned)]

    def take_updates(self, capacity: int) -> tuple[list, list]:
        """(updates for apply_updates, then at most `capacity` TABLE/PARAM updates for the step);
        clears both queues."""
        step, seed = self.step_updates, self.seed_updates
        self.step_updates, self.seed_updates = [], []
        cut = max(len(step) - capacity, 0)
        return seed + step[:cut], step[cut:]
