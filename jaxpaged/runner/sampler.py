"""On-device sampler: logits of the sequences that need a token -> tokens (+ logprobs).

Runs inside the engine's jitted step. Every per-request knob is an array, so a batch that
mixes greedy, top-k, top-p and penalised requests compiles once. The engine always passes
every input (its persistent [R + 1, V] state rows, picked per sample row by `rows`) with
`all_greedy` False and `num_logprobs` at its max_logprobs, so one compiled step serves every
request mix; the work a batch does not need is skipped at run time (`lax.cond` on the row
flags). Called with `all_greedy` True or a [.., V] array None (tests, small tools), that part
is left out of the compiled code instead.
Semantics and order follow vLLM V1: raw logprobs, then logit bias, penalties, greedy argmax,
and for random rows temperature, min_p, top_k, top_p and a draw with a per-request key.

What the logprobs hold is vLLM's `logprobs_mode` (LOGPROBS_MODES): the raw model's log-softmax (the
default) or its logits, or the log-softmax or logits the token was drawn from ("processed": after
bias, bans, penalties, a grammar's mask and custom logits processors, and for a random row
temperature, min_p, top-k and top-p, masked tokens at -inf), what a policy-gradient loop needs as
the behaviour policy's logprobs.
"""

import dataclasses
from dataclasses import field

import jax
import jax.numpy as jnp

from jaxpaged.sampling_params import GREEDY_EPS

# top_k / top_p cut-offs are looked for among this many largest logits before a full sort.
NUM_CANDIDATES = 1024
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclasses.dataclass(frozen=True)
class SamplerLayout:
    """How the sampler lays out its reductions: the same results (tested), platform-specific speed.
    The default is XLA's own ops in the [rows, vocab] layout; `for_platform` is the one place a
    platform gets another, with the measurement that justifies it."""

    vocab_major_greedy: bool = False   # plain-greedy steps take f32[V, S] logits (one column a row)
    masked_argmax: bool = False        # argmax as the max, then the smallest index equal to it
    integer_sort_keys: bool = False    # a full sort orders i32 keys with the floats' order

    @classmethod
    def for_platform(cls, platform: str) -> "SamplerLayout":
        """XLA:CPU (a 2-core CPU, SmolLM2's 49152-token vocabulary, decode-sized S): a [V, S] LM head
        and column reductions run about a third faster than [S, V]; its argmax is a two-operand
        reduction it does not vectorise (7 ms over [49152, 64], the masked form 1 ms); its sort is ~8x
        faster on integers than on floats, whose comparator must also order NaNs. A GPU runs the
        default until the GPU check's `sampler` rows (benchmarks/gpu_check, both layouts) say otherwise."""
        if platform == "cpu":
            return cls(vocab_major_greedy=True, masked_argmax=True, integer_sort_keys=True)
        return cls()

    def argmax(self, x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
        """(the first index of each maximum along `axis` as i32, the maximum)."""
        if self.masked_argmax:
            return first_argmax(x, axis)
        return jnp.argmax(x, axis=axis).astype(jnp.int32), jnp.max(x, axis=axis)

    def sort_descending(self, logits: jax.Array) -> jax.Array:
        """f32[S, V] with each row in descending order."""
        if self.integer_sort_keys:
            return _sort_descending(logits)
        return -jax.lax.sort(-logits, dimension=1, is_stable=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # f32[S]; < GREEDY_EPS means greedy for that row
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1.0 = off
    min_p: jax.Array  # f32[S]; 0.0 = off
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]
    repetition_penalty: jax.Array  # f32[S]; 1.0 = off
    seeds: jax.Array  # u32[S]
    steps: jax.Array  # i32[S]; tokens sampled so far by the request
    requested_logprobs: jax.Array  # i32[S]; top logprobs the row asked for (<= num_logprobs)
    has_logit_bias: jax.Array  # bool[S]; the row's logit_bias row is not all zeros
    output_counts: jax.Array | None  # i32[R, V]; None unless some row has penalties
    prompt_mask: jax.Array | None  # bool[R, V]; None unless some row has penalties
    logit_bias: jax.Array | None  # f32[R, V]; None unless some row has a bias
    all_greedy: bool = field(metadata=dict(static=True))
    num_logprobs: int = field(metadata=dict(static=True))  # K: width of the top-logprobs output
    # the row of the [R, V] arrays each sample row reads (None: row i reads row i, R = S)
    rows: jax.Array | None = None  # i32[S]
    min_tokens_ban: jax.Array | None = None  # bool[R, V]; tokens masked while ban_active
    ban_active: jax.Array | None = None  # bool[S]; the row has not reached its min_tokens
    # structured outputs: bit j of word w of row i allows token 32 w + j (all ones: unconstrained)
    bitmask: jax.Array | None = None  # i32[S, ceil(V / 32)]
    # speculative decoding: the proposed token each row verifies (-1: none; see `sample`)
    draft_tokens: jax.Array | None = None  # i32[S]
    custom: jax.Array | None = None  # bool[S]; a custom logits processor claimed the row (never plain greedy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; raw logprob of the sampled token
    ranks: jax.Array  # i32[S]; 1-based rank of the sampled token
    topk_ids: jax.Array  # i32[S, K]
    topk_logprobs: jax.Array  # f32[S, K]
    accepted: jax.Array | None = None  # bool[S]; the row's draft token was accepted (token_ids = draft)


def token_logprobs(logits: jax.Array, target_ids: jax.Array, num_logprobs: int, wants_top: jax.Array | None = None,
                   normalize: bool = True) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprob and 1-based rank of target_ids[p] under log_softmax(logits[p]), plus the top-K.

    logits: f32[P, V], target_ids: i32[P]. Returns (f32[P], i32[P], i32[P, K], f32[P, K]).
    `wants_top` (a traced bool): when False the top-K is skipped at run time (zeros).
    `normalize` False: the logits themselves instead of their log-softmax (logprobs_mode *_logits).
    """
    logits = logits.astype(jnp.float32)
    # log_softmax is a shift by the row's logsumexp, so ranks and the top-K are taken on the
    # logits and the [P, V] logprobs are never materialised.
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True) if normalize else jnp.zeros((logits.shape[0], 1))
    target_logit = jnp.take_along_axis(logits, target_ids.astype(jnp.int32)[:, None], axis=-1)
    # Ties count in the target's favour, as in vLLM (strictly greater only).
    ranks = jnp.sum(logits > target_logit, axis=-1, dtype=jnp.int32) + 1
    if num_logprobs > 0 and wants_top is not None:
        topk_logits, topk_ids = jax.lax.cond(
            wants_top, lambda x: tuple(jax.lax.top_k(x, num_logprobs)),
            lambda x: (jnp.zeros((x.shape[0], num_logprobs), x.dtype), jnp.zeros((x.shape[0], num_logprobs),
                                                                                   jnp.int32)), logits)
    elif num_logprobs > 0:
        topk_logits, topk_ids = jax.lax.top_k(logits, num_logprobs)
    else:
        topk_logits = jnp.zeros((logits.shape[0], 0), jnp.float32)
        topk_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return (target_logit - lse)[:, 0], ranks, topk_ids.astype(jnp.int32), topk_logits - lse


def penalised_rows(md) -> jax.Array:
    """bool[S]: rows whose penalties change their logits."""
    return (md.presence_penalty != 0) | (md.frequency_penalty != 0) | (md.repetition_penalty != 1.0)


def _rows_of(md, array):
    """The [S, V] rows of a [R, V] array that this batch's sample rows read (inside a branch, so
    the gather runs only when the branch does)."""
    return array if md.rows is None else array[md.rows]


def constrained_rows(md) -> jax.Array | None:
    """bool[S]: rows a structured-output bitmask restricts (None: no bitmask input)."""
    return None if md.bitmask is None else jnp.any(md.bitmask != -1, axis=1)


def _apply_bitmask(logits, bitmask):
    ids = jnp.arange(logits.shape[1], dtype=jnp.int32)
    words = bitmask[:, ids >> 5]                                    # [S, V]
    allowed = ((words >> (ids & 31)) & 1).astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _where_any(rows, fn, x, branch_free: bool):
    """fn(x) if any of `rows` (bool[S]) is set, else x. fn changes only those rows, so branch-free
    (XLA:GPU reads a conditional's predicate on the host: see runner/step.py) it simply runs."""
    return fn(x) if branch_free else jax.lax.cond(jnp.any(rows), fn, lambda y: y, x)


def _apply_bias_and_penalties(logits, md, branch_free: bool = False):
    if md.bitmask is not None:
        logits = _where_any(constrained_rows(md), lambda x: _apply_bitmask(x, md.bitmask), logits, branch_free)
    if md.logit_bias is not None:
        logits = _where_any(md.has_logit_bias,
                            lambda x: x + jnp.where(md.has_logit_bias[:, None], _rows_of(md, md.logit_bias), 0.0),
                            logits, branch_free)
    if md.min_tokens_ban is not None:
        logits = _where_any(md.ban_active,
                            lambda x: jnp.where(md.ban_active[:, None] & _rows_of(md, md.min_tokens_ban), -jnp.inf, x),
                            logits, branch_free)
    if md.output_counts is None:
        return logits
    return _where_any(penalised_rows(md), lambda x: _apply_penalties(x, md), logits, branch_free)


def _apply_penalties(logits, md):
    counts = _rows_of(md, md.output_counts)
    output_mask = counts > 0
    seen = output_mask if md.prompt_mask is None else output_mask | _rows_of(md, md.prompt_mask)
    # within [1e-30, 1e30]: a penalty that float32 flushes to 0 (or its reciprocal) would turn a masked
    # -inf into a NaN (-inf x 0), which an argmax picks; the limits change nothing a logit can show
    rep = jnp.where(seen, jnp.clip(md.repetition_penalty, 1e-30, 1e30)[:, None], 1.0)
    # Dividing a negative logit would raise it, so those are multiplied instead.
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - md.presence_penalty[:, None] * output_mask.astype(jnp.float32)


def _flip_negatives(bits):
    """i32 bits of an f32 <-> an i32 with the float's order (its own inverse; SamplerLayout.integer_sort_keys)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _sort_descending(logits):
    keys = _flip_negatives(jax.lax.bitcast_convert_type(logits, jnp.int32))
    ordered_keys = ~jax.lax.sort(~keys, dimension=1, is_stable=False)
    return jax.lax.bitcast_convert_type(_flip_negatives(ordered_keys), jnp.float32)


def _cutoff(ordered, row_max, k, top_p, vocab, full_mass):
    """Each row's lowest kept value, from its `num` largest values `ordered` (f32[S, num],
    descending). full_mass: sum of exp(logits - row_max) over the whole row, needed when top_k
    is off and num < vocab. Returns (cutoff f32[S], decided bool[S]): decided is False where
    the cut-off lies beyond these `num` values."""
    num = ordered.shape[-1]
    in_top_k = jnp.arange(num)[None, :] < k[:, None]
    weights = jnp.where(in_top_k, jnp.exp(ordered - row_max[:, None]), 0.0)
    cum = jnp.cumsum(weights, axis=-1)
    total = cum[:, -1] if full_mass is None else jnp.where(k <= num, cum[:, -1], full_mass)
    # f32 sums over a big vocab are not exact: top_p == 1 must keep everything regardless.
    keep_all = top_p >= 1.0
    keep = in_top_k & ((cum - weights < (top_p * total)[:, None]) | keep_all[:, None])
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    cutoff = jnp.take_along_axis(ordered, (num_keep - 1)[:, None], axis=-1)[:, 0]
    cutoff = jnp.where(keep_all & (k >= vocab), -jnp.inf, cutoff)
    decided = (k <= num) | ((k >= vocab) & (keep_all | (cum[:, -1] >= top_p * total)))
    return cutoff, decided


def _apply_top_k_top_p(logits, top_k, top_p, active, num_candidates=NUM_CANDIDATES,
                       layout: SamplerLayout = SamplerLayout()):
    """Mask everything below each row's cut-off value to -inf. The cut-off is looked for among
    the row's `num_candidates` largest values first (lax.top_k is ~10x cheaper than a full sort
    on CPU); only when some active row's cut-off lies beyond them is every row sorted."""
    vocab = logits.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    # The max is taken apart from the candidates: XLA turns a top_k whose result is also
    # sliced elsewhere back into a full float sort.
    row_max = jnp.max(logits, axis=-1)
    candidates = jax.lax.top_k(logits, min(num_candidates, vocab))[0]
    full_mass = jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1)
    cutoff, decided = _cutoff(candidates, row_max, k, top_p, vocab, full_mass)
    cutoff = jax.lax.cond(
        jnp.all(decided | ~active),
        lambda: cutoff,
        lambda: _cutoff(layout.sort_descending(logits), row_max, k, top_p, vocab, None)[0],
    )
    # Ties with the cut-off value are kept (vLLM keeps them for top_k, drops some for top_p).
    return jnp.where(logits < cutoff[:, None], -jnp.inf, logits)


def _row_gumbel(seed, step, vocab):
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def first_argmax(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """(jnp.argmax(x, axis) as i32, jnp.max(x, axis)): the first index of each maximum, found as the
    smallest index equal to it (SamplerLayout.masked_argmax); the barrier keeps XLA from fusing the max
    into its consumers (recomputed there, it cost more than it saved). A NaN row gives its last index
    (argmax: the first NaN's)."""
    n = x.shape[axis]
    top = jnp.max(x, axis=axis)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis % x.ndim)
    first = jnp.min(jnp.where(x == jnp.expand_dims(top, axis), index, n), axis=axis)
    first, top = jax.lax.optimization_barrier((jnp.minimum(first, n - 1), top))
    return first, top


def _random_sample(logits, md, truncation: bool = True, layout: SamplerLayout = SamplerLayout()):
    """Gumbel-max draws of every row (greedy rows' are discarded by the caller), and the logits they were
    drawn from. truncation False: no row has top-k or top-p (the caller knows), and their skip's
    conditional is left out."""
    is_greedy = md.temperature < GREEDY_EPS
    temperature = jnp.where(is_greedy, 1.0, md.temperature)
    # a masked token stays masked: XLA divides by multiplying with 1 / T, which a temperature past
    # ~1e38 flushes to 0, and -inf x 0 is a NaN, which an argmax would pick
    logits = jnp.where(logits == -jnp.inf, -jnp.inf, logits / temperature[:, None])
    # min_p in logit space: p_i < min_p * p_max  <=>  l_i < l_max + log(min_p).
    floor = jnp.max(logits, axis=-1) + jnp.log(md.min_p)
    logits = jnp.where(logits < floor[:, None], -jnp.inf, logits)
    if truncation:
        truncated = ~is_greedy & ((md.top_k > 0) | (md.top_p < 1.0))
        logits = jax.lax.cond(
            jnp.any(truncated),
            lambda x: _apply_top_k_top_p(x, md.top_k, md.top_p, truncated, layout=layout),
            lambda x: x,
            logits,
        )
    # Gumbel-max: the noise of a row depends only on its (seed, step), never on the batch.
    noise = jax.vmap(_row_gumbel, in_axes=(0, 0, None))(md.seeds, md.steps, logits.shape[-1])
    return layout.argmax(logits + noise, -1)[0], logits


def uses_output_tokens(params) -> bool:
    """Whether a request's penalties read its tokens (its slot then keeps their counts and prompt mask)."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def uses_bias_row(request) -> bool:
    """Whether a request's sampling adds its slot's logit_bias row: logit_bias, allowed_token_ids, or bad
    words of one token (persistent_batch.seeded_bias)."""
    p = request.sampling_params
    return bool(p.logit_bias or p.allowed_token_ids or request.banned_token_ids)


def is_plain_greedy(md: SamplingMetadata) -> jax.Array:
    """bool: every row greedy with no bias, penalties or top logprobs (traced: picks the fast path)."""
    plain = (jnp.all(md.temperature < GREEDY_EPS) & ~jnp.any(md.has_logit_bias) & ~jnp.any(penalised_rows(md))
             & ~jnp.any(md.requested_logprobs > 0))
    if md.bitmask is not None:
        plain = plain & ~jnp.any(constrained_rows(md))
    if md.custom is not None:
        plain = plain & ~jnp.any(md.custom)
    return plain if md.ban_active is None else plain & ~jnp.any(md.ban_active)


def plain_greedy(logits: jax.Array, vocab_axis: int, num_logprobs: int = 0, draft_tokens: jax.Array | None = None,
                 layout: SamplerLayout = SamplerLayout(), logprobs_mode: str = "raw_logprobs") -> SamplerOutput:
    """The plain-greedy sampler (is_plain_greedy) on f32 logits with the vocabulary on `vocab_axis`
    ([S, V]: 1; [V, S], SamplerLayout.vocab_major_greedy: 0); top-K left as zeros. A row's draft
    token (speculative decoding) is accepted when it is the argmax. The argmax has rank 1; its
    logprob is max - logsumexp (its logit in a *_logits mode; nothing processes a plain row's logits)."""
    tokens, top = layout.argmax(logits, vocab_axis)
    empty = jnp.zeros((tokens.shape[0], num_logprobs), jnp.int32)
    accepted = None if draft_tokens is None else tokens == draft_tokens
    if logprobs_mode.endswith("_logits"):
        return SamplerOutput(tokens, top, jnp.ones_like(tokens), empty, empty.astype(jnp.float32), accepted)
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - jnp.expand_dims(top, vocab_axis)), axis=vocab_axis))
    return SamplerOutput(tokens, top - lse, jnp.ones_like(tokens), empty, empty.astype(jnp.float32), accepted)


def sample(logits: jax.Array, md: SamplingMetadata, branch_free: bool = False,
           layout: SamplerLayout = SamplerLayout(), logprobs_mode: str = "raw_logprobs", process=None
           ) -> SamplerOutput:
    """Turn f32[S, V] logits into one token per row; pure, meant to run inside a jit.

    Speculative decoding (`md.draft_tokens`): a row verifies its draft token d by drawing its own
    token as it would without speculation (the argmax; or the Gumbel-max draw of its (seed, step))
    and accepting d when they agree. For a one-hot proposal q that is exactly speculative sampling's
    rule: d is accepted with probability p(d) = min(1, p(d) / q(d)), and a token drawn in its place
    is distributed as max(p - q, 0) renormalised (p without d). So the distribution is kept and a
    seeded request gets the very tokens it gets without speculation, whichever positions are
    verified. A sequence keeps its rows' tokens up to its first rejection (runner/step.py).

    branch_free: no conditional at all (for a GPU, where the host knows that no row has top-k or
    top-p): every row-masked part runs, and the top-K logprobs are taken for every row.

    logprobs_mode (LOGPROBS_MODES): what the logprobs are taken from (see the module docstring).

    process: custom logits processors (f32[S, V] -> f32[S, V], jaxpaged.logits_processor), after bias,
    penalties and masks, before temperature and truncation (vLLM's order); None: none."""
    logits = logits.astype(jnp.float32)
    processed = _apply_bias_and_penalties(logits, md, branch_free)
    if process is not None:
        processed = process(processed)
    tokens = layout.argmax(processed, -1)[0]
    drawn_from = processed   # the logits each row's token comes from (processed modes)
    if not md.all_greedy:
        is_random = md.temperature >= GREEDY_EPS
        if branch_free:
            random_tokens, random_logits = _random_sample(processed, md, truncation=False, layout=layout)
        elif logprobs_mode.startswith("processed"):
            random_tokens, random_logits = jax.lax.cond(
                jnp.any(is_random), lambda: _random_sample(processed, md, layout=layout), lambda: (tokens, processed))
        else:   # (the drawn-from logits are not needed: the conditional does not return them)
            random_tokens = jax.lax.cond(jnp.any(is_random), lambda: _random_sample(processed, md, layout=layout)[0],
                                         lambda: tokens)
        tokens = jnp.where(is_random, random_tokens, tokens)
        if logprobs_mode.startswith("processed"):   # (a greedy row's: its processed logits)
            drawn_from = jnp.where(is_random[:, None], random_logits, processed)
    accepted = None if md.draft_tokens is None else tokens == md.draft_tokens
    lp, ranks, topk_ids, topk_lp = token_logprobs(drawn_from if logprobs_mode.startswith("processed") else logits,
                                                  tokens, md.num_logprobs,
                                                  None if branch_free else jnp.any(md.requested_logprobs > 0),
                                                  normalize=logprobs_mode.endswith("_logprobs"))
    return SamplerOutput(tokens, lp, ranks, topk_ids, topk_lp, accepted)
