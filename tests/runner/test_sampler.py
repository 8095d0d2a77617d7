"""Sampler behaviour a user would notice: greedy, temperature, top-k/p, min-p, seeds,
penalties, logit bias and logprobs. Few shapes (S in {1, 8, 4096}, V = 16) keep compiles few;
statistical tests use thousands of seeded rows in one jitted call, so they are deterministic."""

import types

import jax
import numpy as np
import pytest
from scipy import stats

from jaxpaged.runner.sampler import SamplerLayout, _apply_top_k_top_p, sample, token_logprobs
from tests.runner.sampler_helpers import build_sampling_metadata

V = 16
S = 8
S_BIG = 4096
sample_jit = jax.jit(sample)
token_logprobs_jit = jax.jit(token_logprobs, static_argnums=2)
truncate_jit = jax.jit(_apply_top_k_top_p, static_argnums=4)


def params(**overrides):
    fields = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
                  frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, logprobs=None)
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def metadata(rows, padded_size, seeds=None, steps=None, outputs=None, prompts=None, extra=None):
    n = len(rows)
    return build_sampling_metadata(
        rows, seeds if seeds is not None else list(range(n)), steps if steps is not None else [0] * n,
        outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)], extra or [None] * n,
        vocab_size=V, padded_size=padded_size)


def run(logits, md):
    out = sample_jit(np.asarray(logits, np.float32), md)
    return jax.tree.map(np.asarray, out)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) - x.max(-1, keepdims=True)


def softmax(x):
    return np.exp(log_softmax(x))


def test_greedy_is_argmax_and_padding_rows_are_harmless():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(S, V)).astype(np.float32)
    logits[3] = -np.inf  # padding rows may hold anything
    logits[4] = np.nan
    logits[5] = 1e30
    md = metadata([params(temperature=0.0)] * 3, S)
    assert md.all_greedy
    out = run(logits, md)
    np.testing.assert_array_equal(out.token_ids[:3], logits[:3].argmax(-1))
    assert np.all((out.token_ids >= 0) & (out.token_ids < V))
    assert np.all(np.isfinite(out.logprobs[:3]))


def test_temperature_frequencies_follow_softmax_over_temperature():
    logits = np.random.default_rng(1).permutation(np.linspace(-1.0, 1.0, V))
    half = S_BIG // 2
    rows = [params(temperature=0.5)] * half + [params(temperature=2.0)] * half
    out = run(np.tile(logits, (S_BIG, 1)), metadata(rows, S_BIG, seeds=list(range(1000, 1000 + S_BIG))))
    critical = stats.chi2.ppf(1 - 1e-6, df=V - 1)

    def chi_square(tokens, temperature):
        expected = softmax(logits / temperature) * len(tokens)
        return np.sum((np.bincount(tokens, minlength=V) - expected) ** 2 / expected)

    for group, temperature, wrong in ((slice(0, half), 0.5, 1.0), (slice(half, None), 2.0, 1.0)):
        assert chi_square(out.token_ids[group], temperature) < critical
        # The same draws must reject a sampler that ignored the temperature.
        assert chi_square(out.token_ids[group], wrong) > critical


def _allowed(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM V1 order: temperature, min_p, top_k, top_p; returns the set of token ids left."""
    probs = softmax(logits / temperature)
    alive = probs >= min_p * probs.max()
    order = np.argsort(-probs, kind="stable")
    order = order[alive[order]][: top_k or None]
    kept = probs[order] / probs[order].sum()
    mass_before = np.cumsum(kept) - kept
    assert top_p >= 1 or np.min(np.abs(mass_before - top_p)) > 1e-3, "logits on the top_p boundary"
    return set(order[mass_before < top_p].tolist())


def test_top_k_top_p_min_p_sample_exactly_the_allowed_support():
    rng = np.random.default_rng(2)
    groups = [dict(top_k=5), dict(top_p=0.7), dict(min_p=0.3, temperature=2.0),
              dict(top_k=6, top_p=0.8, min_p=0.1, temperature=0.8)]
    size = S_BIG // len(groups)
    group_logits = [rng.permutation(np.linspace(-1.5, 1.5, V)) for _ in groups]
    logits = np.repeat(np.stack(group_logits), size, axis=0)
    rows = [params(**g) for g in groups for _ in range(size)]
    out = run(logits, metadata(rows, S_BIG))
    for i, (g, group_logit) in enumerate(zip(groups, group_logits)):
        allowed = _allowed(group_logit, **g)
        assert 1 < len(allowed) < V
        sampled = set(out.token_ids[i * size:(i + 1) * size].tolist())
        assert sampled == allowed, g


@pytest.mark.parametrize("configs", [
    # every cut-off lies within the 4 largest logits: decided without the full sort
    [(3, 1.0), (0, 0.7), (2, 0.5), (4, 0.9), (0, 1.0), (1, 1.0), (0, 0.3), (3, 0.6)],
    # some lie beyond them: the whole batch falls back to the full sort
    [(10, 1.0), (0, 0.95), (10, 0.5), (0, 0.7), (15, 0.99), (0, 1.0), (16, 0.8), (5, 1.0)],
])
def test_top_k_top_p_cutoffs_do_not_depend_on_the_candidate_shortcut(configs):
    rng = np.random.default_rng(6)
    logits = np.stack([rng.permutation(np.linspace(-4.0, 4.0, V)) for _ in range(S)]).astype(np.float32)
    top_k, top_p = (np.array(c) for c in zip(*configs))
    masked = np.asarray(truncate_jit(logits, top_k.astype(np.int32), top_p.astype(np.float32),
                                     np.ones(S, bool), 4))
    for row, (k, p) in enumerate(configs):
        assert set(np.isfinite(masked[row]).nonzero()[0].tolist()) == _allowed(logits[row], top_k=k, top_p=p)


def test_same_seed_and_step_give_the_same_token_anywhere():
    rng = np.random.default_rng(3)
    seeds, steps = [11, 22, 33, 44, 55, 66, 77, 88], [0, 1, 2, 3, 4, 5, 6, 7]
    row_logits = rng.normal(scale=0.3, size=(S, V))
    base = run(row_logits, metadata([params()] * S, S, seeds=seeds, steps=steps)).token_ids
    assert len(set(base.tolist())) > 1

    perm = np.array([5, 2, 7, 0, 3, 6, 1, 4])
    moved = run(row_logits[perm], metadata([params()] * S, S, seeds=[seeds[p] for p in perm],
                                           steps=[steps[p] for p in perm])).token_ids
    np.testing.assert_array_equal(moved, base[perm])

    alone = run(row_logits[6:7], metadata([params()], 1, seeds=[77], steps=[6])).token_ids
    assert alone[0] == base[6]

    big_logits = rng.normal(size=(S_BIG, V))
    big_seeds, big_steps = list(rng.integers(0, 2**32, S_BIG)), [9] * S_BIG
    at = 1000 + np.arange(S) * 3
    big_logits[at] = row_logits
    for j, a in enumerate(at):
        big_seeds[a], big_steps[a] = seeds[j], steps[j]
    big = run(big_logits, metadata([params()] * S_BIG, S_BIG, seeds=big_seeds, steps=big_steps))
    np.testing.assert_array_equal(big.token_ids[at], base)


def test_different_steps_give_different_streams():
    flat = np.zeros((S_BIG, V))
    one_seed = run(flat, metadata([params()] * S_BIG, S_BIG, seeds=[7] * S_BIG,
                                  steps=list(range(S_BIG)))).token_ids
    assert np.bincount(one_seed, minlength=V).min() > S_BIG / V / 2  # a uniform-looking stream
    seeds = list(range(S_BIG))
    step0 = run(flat, metadata([params()] * S_BIG, S_BIG, seeds=seeds, steps=[0] * S_BIG)).token_ids
    step1 = run(flat, metadata([params()] * S_BIG, S_BIG, seeds=seeds, steps=[1] * S_BIG)).token_ids
    assert np.mean(step0 == step1) < 2 / V


def _penalty_logits(rows):
    logits = np.zeros((S, V), np.float32)
    for i, values in enumerate(rows):
        for token, value in values.items():
            logits[i, token] = value
    return logits


def test_penalties_and_logit_bias_change_the_argmax_as_vllm():
    g = dict(temperature=0.0)
    rows = [  # (params, prompt, output, logits, expected argmax)
        (params(**g), [1], [1, 1], {1: 2.0, 2: 1.5}, 1),
        (params(repetition_penalty=1.5, **g), [1], [], {1: 2.0, 2: 1.5}, 2),
        # A negative logit is multiplied, not divided: -0.5 -> -0.75 drops below -0.6.
        (params(repetition_penalty=1.5, **g), [], [1], {**{t: -1.0 for t in range(V)}, 1: -0.5, 2: -0.6}, 2),
        (params(frequency_penalty=0.2, **g), [], [1, 1, 1], {1: 2.0, 2: 1.5}, 2),
        (params(frequency_penalty=0.2, **g), [], [1], {1: 2.0, 2: 1.5}, 1),
        (params(presence_penalty=0.6, **g), [1], [], {1: 2.0, 2: 1.5}, 1),  # prompt only: no effect
        (params(presence_penalty=0.6, **g), [], [1], {1: 2.0, 2: 1.5}, 2),
        (params(logit_bias={5: 3.0}, **g), [], [], {1: 2.0, 2: 1.5}, 5),
    ]
    logits = _penalty_logits([r[3] for r in rows])
    md = metadata([r[0] for r in rows], S, prompts=[r[1] for r in rows], outputs=[r[2] for r in rows])
    assert md.output_counts is not None and md.logit_bias is not None
    out = run(logits, md)
    np.testing.assert_array_equal(out.token_ids, [r[4] for r in rows])
    # Returned logprobs are those of the raw logits, not of the penalised ones.
    raw = log_softmax(logits)[np.arange(S), out.token_ids]
    np.testing.assert_allclose(out.logprobs, raw, rtol=1e-5, atol=1e-5)

    rows = [  # bias comes before the repetition penalty: (1.0 + 1.0) / 2 = 1.0 < 1.2
        (params(repetition_penalty=2.0, logit_bias={1: 1.0}, **g), [1], [], {1: 1.0, 2: 1.2}, None, 2),
        (params(**g), [], [], {1: 2.0, 2: 1.5}, {1: -np.inf}, 2),  # min_tokens hides EOS = 1
        (params(**g), [], [], {1: 2.0, 2: 1.5}, None, 1),
    ]
    logits = _penalty_logits([r[3] for r in rows])
    md = metadata([r[0] for r in rows], S, prompts=[r[1] for r in rows], outputs=[r[2] for r in rows],
                  extra=[r[4] for r in rows])
    np.testing.assert_array_equal(run(logits, md).token_ids[:3], [r[5] for r in rows])


def test_logprobs_ranks_and_top_k_follow_raw_log_softmax():
    rng = np.random.default_rng(4)
    logits = rng.normal(scale=2.0, size=(S, V)).astype(np.float32)
    rows = [params(logprobs=2), params(temperature=0.0, logprobs=4), params(top_k=3), params(top_p=0.5)]
    md = metadata(rows, S)
    assert md.num_logprobs == 4
    out = run(logits, md)
    expected = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    rows_idx = np.arange(S)
    np.testing.assert_allclose(out.logprobs, expected[rows_idx, out.token_ids], rtol=1e-5, atol=1e-6)
    ranks = 1 + np.sum(expected > expected[rows_idx, out.token_ids][:, None], axis=-1)
    np.testing.assert_array_equal(out.ranks, ranks)
    assert out.topk_ids.shape == (S, 4) and out.topk_logprobs.shape == (S, 4)
    np.testing.assert_array_equal(out.topk_ids, np.argsort(-expected, axis=-1)[:, :4])
    np.testing.assert_allclose(out.topk_logprobs, np.sort(expected, axis=-1)[:, ::-1][:, :4], atol=1e-6)
    assert np.all(np.diff(out.topk_logprobs, axis=-1) <= 0)
    assert out.ranks[1] == 1 and out.ranks[2] <= 3  # greedy picks the top; top_k=3 stays in it


def test_token_logprobs_against_numpy():
    rng = np.random.default_rng(5)
    logits = rng.normal(scale=3.0, size=(S, V)).astype(np.float32)
    logits[0, :4] = logits[0, 4]  # a tie: equal logits share the better rank
    targets = rng.integers(0, V, S).astype(np.int32)
    targets[0] = 2
    lp, rank, topk_ids, topk_lp = map(np.asarray, token_logprobs_jit(logits, targets, 3))
    expected = log_softmax(logits)
    target_lp = expected[np.arange(S), targets]
    np.testing.assert_allclose(lp, target_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(rank, 1 + np.sum(logits > logits[np.arange(S), targets][:, None], -1))
    np.testing.assert_allclose(topk_lp, np.sort(expected, -1)[:, ::-1][:, :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(expected, topk_ids, -1), topk_lp, rtol=1e-5, atol=1e-5)


def test_build_sampling_metadata_leaves_unused_vocab_arrays_none():
    md = metadata([params(temperature=0.0), params(temperature=0.7, top_k=-1)], S)
    assert md.output_counts is None and md.prompt_mask is None and md.logit_bias is None
    assert not md.all_greedy and md.num_logprobs == 0
    assert md.temperature.shape == (S,) and md.seeds.dtype == np.uint32 and md.steps.dtype == np.int32
    np.testing.assert_array_equal(md.top_k[:2], [0, 0])
    assert np.all(md.temperature[2:] == 0) and np.all(md.top_p[2:] == 1) and np.all(md.repetition_penalty[2:] == 1)

    md = metadata([params(temperature=0.0)], S, extra=[{3: -np.inf}])
    assert md.all_greedy and md.output_counts is None
    assert md.logit_bias.shape == (S, V) and md.logit_bias[0, 3] == -np.inf and np.sum(md.logit_bias != 0) == 1

    md = metadata([params(), params(frequency_penalty=0.5, logprobs=3)], S, outputs=[[1], [2, 2, 5]],
                  prompts=[[0], [7, 7]])
    assert md.output_counts.shape == (S, V) and md.prompt_mask.shape == (S, V) and md.logit_bias is None
    np.testing.assert_array_equal(md.output_counts[1], np.bincount([2, 2, 5], minlength=V))
    assert md.prompt_mask[1].nonzero()[0].tolist() == [7] and md.num_logprobs == 3


@pytest.mark.parametrize("call, name", [
    (lambda: build_sampling_metadata([params()], [1, 2], [0], [[]], [[]], [None], V, S), "seeds"),
    (lambda: metadata([params()] * 3, 2), "padded_size"),
    (lambda: metadata([params(logit_bias={V: 1.0})], S), "logit_bias"),
    (lambda: metadata([params(top_p=0.0)], S), "top_p"),
    (lambda: metadata([params(temperature=-1.0)], S), "temperature"),
    (lambda: metadata([params(repetition_penalty=1.2)], S, outputs=[[V + 3]]), "output_token_ids"),
])
def test_build_sampling_metadata_rejects_bad_input(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("layout", [SamplerLayout(), SamplerLayout.for_platform("cpu")], ids=["default", "cpu"])
def test_plain_greedy_equals_the_general_sampler_in_either_layout(layout):
    from types import SimpleNamespace

    from jaxpaged.runner.sampler import is_plain_greedy, plain_greedy

    g = SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, logprobs=None)
    logits = jax.random.normal(jax.random.key(3), (5, 40)) * 4
    md = build_sampling_metadata([g] * 5, [0] * 5, [0] * 5, [[]] * 5, [[]] * 5, [None] * 5, 40, 5)
    assert is_plain_greedy(md)
    ref = sample(logits, md)
    for fast in (plain_greedy(logits.T, 0, layout=layout), plain_greedy(logits, 1, layout=layout)):
        np.testing.assert_array_equal(np.asarray(fast.token_ids), np.asarray(ref.token_ids))
        np.testing.assert_allclose(np.asarray(fast.logprobs), np.asarray(ref.logprobs), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(fast.ranks), np.asarray(ref.ranks))


def test_the_cpu_layout_samples_what_the_default_samples():
    """Seeded top-k / top-p draws past the candidates (a full sort), ties and greedy rows: the same tokens
    and logprobs whichever SamplerLayout (argmax form, sort keys) runs them."""
    from types import SimpleNamespace

    def params(**kw):
        base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                    repetition_penalty=1.0, logit_bias=None, logprobs=3)
        return SimpleNamespace(**{**base, **kw})

    rows = [params(temperature=0.0), params(top_k=1500), params(top_p=0.999), params(top_k=3, top_p=0.5),
            params()]
    vocab = 2048
    logits = jax.random.normal(jax.random.key(9), (len(rows), vocab)) * 3
    logits = logits.at[0, [11, 900]].set(50.0)   # a tie: the first index wins
    md = build_sampling_metadata(rows, [1, 2, 3, 4, 5], [0] * 5, [[]] * 5, [[]] * 5, [None] * 5, vocab, 5)
    ref = sample(logits, md, layout=SamplerLayout())
    cpu = sample(logits, md, layout=SamplerLayout.for_platform("cpu"))
    assert int(ref.token_ids[0]) == 11
    for name in ("token_ids", "logprobs", "ranks", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(ref, name)), np.asarray(getattr(cpu, name)), err_msg=name)


def test_first_argmax_is_argmax_with_ties_and_masked_rows():
    """The sampler's argmax (max, then the smallest index at it): the first of tied maxima, as
    jnp.argmax, on either axis; a fully masked row (all -inf) gives 0, as jnp.argmax."""
    from jaxpaged.runner.sampler import first_argmax

    x = np.asarray(jax.random.randint(jax.random.key(5), (6, 40), 0, 4), np.float32)   # many ties
    x[2] = -np.inf
    x[3, [7, 30]] = 9.0
    for axis, data in ((-1, x), (0, x.T)):
        index, top = jax.jit(first_argmax, static_argnums=1)(data, axis)
        np.testing.assert_array_equal(np.asarray(index), np.argmax(data, axis=axis))
        np.testing.assert_array_equal(np.asarray(top), np.max(data, axis=axis))
    assert int(first_argmax(x, -1)[0][3]) == 7
