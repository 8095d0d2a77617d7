"""The grouped expert matmuls of jaxpaged.models.moe against every expert run densely: the same
outputs whatever the routing (balanced, all on one expert, groups across tile boundaries, empty
experts), and routing as transformers does it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models.moe import TILE_ROWS, Routing, moe_mlp, resolve_moe_impl, route

HIDDEN, INTER, EXPERTS = 24, 20, 6


def weights(seed: int):
    rng = np.random.default_rng(seed)
    router = jnp.asarray(rng.normal(0, 0.5, (HIDDEN, EXPERTS)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(0, 0.3, (EXPERTS, HIDDEN, 2 * INTER)), jnp.float32)
    down = jnp.asarray(rng.normal(0, 0.3, (EXPERTS, INTER, HIDDEN)), jnp.float32)
    return router, gate_up, down


@pytest.mark.parametrize("impl", ["loop", "ragged_dot"])
@pytest.mark.parametrize("num_tokens,top_k,skew,gpt_oss", [(1, 2, False, False), (7, 2, False, False),
                                                            (40, 3, False, False), (2 * TILE_ROWS + 3, 1, True, False),
                                                            (50, 2, True, False), (7, 2, False, True),
                                                            (2 * TILE_ROWS + 3, 2, True, True)])
def test_grouped_experts_equal_every_expert_run_densely(impl, num_tokens, top_k, skew, gpt_oss):
    """gpt_oss: biases on the router and each expert's projections, the clamped SwiGLU (a clamp that bites)."""
    router, gate_up, down = weights(num_tokens)
    if skew:   # nearly every token to expert 4: one long group over several tiles, most experts empty
        router = router.at[:, 4].add(5.0)
    x = jnp.asarray(np.random.default_rng(1).normal(0, 1, (num_tokens, HIDDEN)), jnp.float32)
    args = dict(routing=Routing(top_k, normalize=True), act="silu")
    if gpt_oss:
        rng = np.random.default_rng(2)
        args.update(act=("swiglu_clamped", 0.5, 1.702), router_bias=jnp.asarray(rng.normal(0, 0.5, EXPERTS)),
                    b_gate_up=jnp.asarray(rng.normal(0, 0.3, (EXPERTS, 2 * INTER)), jnp.float32),
                    b_down=jnp.asarray(rng.normal(0, 0.3, (EXPERTS, HIDDEN)), jnp.float32))
    ours = jax.jit(lambda x: moe_mlp(x, router, gate_up, down, impl=impl, **args))(x)
    dense = moe_mlp(x, router, gate_up, down, impl="dense", **args)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(dense), rtol=2e-5, atol=2e-5)


def test_routing_is_softmax_top_k_renormalized_or_not():
    router, _, _ = weights(0)
    x = jnp.asarray(np.random.default_rng(2).normal(0, 1, (5, HIDDEN)), jnp.float32)
    probs = np.asarray(jax.nn.softmax(x @ router, axis=-1))
    for normalize in (False, True):
        w, ids = route(x, router, Routing(2, normalize))
        expected_ids = np.argsort(-probs, axis=-1)[:, :2]
        np.testing.assert_array_equal(np.asarray(ids), expected_ids)
        expected = np.take_along_axis(probs, expected_ids, -1)
        if normalize:
            expected = expected / expected.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-6)


def reference_grouped_route(logits, correction, k, groups, kept, group_score, scale, sigmoid):
    """DeepSeek-V2 / V3's routers as transformers writes them, one token at a time in numpy."""
    out_w, out_ids = [], []
    for row in logits.astype(np.float64):
        scores = 1 / (1 + np.exp(-row)) if sigmoid else np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        choice = (scores + correction).reshape(groups, -1)
        group_scores = choice.max(-1) if group_score == "max" else np.sort(choice, -1)[:, -2:].sum(-1)
        masked = np.full_like(choice, -np.inf)
        for g in np.argsort(-group_scores)[:kept]:
            masked[g] = choice[g]
        ids = np.sort(np.argsort(-masked.reshape(-1))[:k])
        w = scores[ids] / (scores[ids].sum() if sigmoid else 1.0)
        out_w.append(w * scale)
        out_ids.append(ids)
    return np.array(out_w), np.array(out_ids)


@pytest.mark.parametrize("sigmoid", [False, True])
def test_grouped_routing_chooses_within_the_best_groups_as_deepseek(sigmoid):
    """V2 (softmax, groups by their best expert, weights not renormalized) and V3 (sigmoid, a correction
    bias that steers the choice but not the weights, groups by their two best, renormalized), both scaled."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(0, 1, (9, HIDDEN)), jnp.float32)
    router = jnp.asarray(rng.normal(0, 0.5, (HIDDEN, 8)), jnp.float32)
    correction = rng.normal(0, 0.3, 8).astype(np.float32) if sigmoid else np.zeros(8, np.float32)
    routing = Routing(3, normalize=sigmoid, scoring="sigmoid" if sigmoid else "softmax", groups=(4, 2),
                      group_score="top2" if sigmoid else "max", scale=2.5)
    w, ids = route(x, router, routing, correction=jnp.asarray(correction) if sigmoid else None)
    order = np.argsort(np.asarray(ids), -1)
    expected_w, expected_ids = reference_grouped_route(np.asarray(x @ router), correction, 3, 4, 2,
                                                       routing.group_score, 2.5, sigmoid)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1), expected_ids)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1), expected_w, rtol=1e-5)
    _, ungrouped = route(x, router, Routing(3, scoring=routing.scoring))
    assert not np.array_equal(np.asarray(ungrouped), np.asarray(ids))   # the groups (and the bias) change choices


def test_impl_names():
    assert resolve_moe_impl("auto", "cpu") == "loop" and resolve_moe_impl("auto", "gpu") == "ragged_dot"
    with pytest.raises(ValueError, match="moe_impl must be one of auto, ragged_dot, loop, dense"):
        resolve_moe_impl("megablocks")
