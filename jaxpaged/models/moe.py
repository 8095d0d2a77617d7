"""Mixture-of-experts feed-forward: each token runs through its top-k experts only.

    router   logits = x @ router [tokens, experts]; scores (softmax, or DeepSeek-V3's sigmoid) in f32; top-k
             (of the best expert groups where the router has groups); renormalized or not; scaled (`Routing`)
    sort     the tokens x k (token, expert) pairs ordered by expert: each expert's rows are contiguous
    experts  act(rows @ gate_up[e]) * ... @ down[e] for exactly those rows (`expert_mlp`)
    combine  each pair's output times its routing weight, added back onto its token

The expert weights are stacked: `w_experts_gate_up` [experts, hidden, 2 x moe_intermediate] (gate | up
per expert) and `w_experts_down` [experts, moe_intermediate, hidden]; gpt-oss adds a bias to the router's
logits and to each expert's projections (`b_experts_gate_up` [experts, 2 x moe_intermediate],
`b_experts_down` [experts, hidden]) and gates with a clamped SwiGLU (`_gated`). `expert_mlp` has three
implementations with one meaning (`MOE_IMPLS`):

- "ragged_dot": two `jax.lax.ragged_dot` grouped GEMMs over the sorted rows (XLA's on GPU).
- "loop": a scan over the experts, each walking its own rows in tiles of `TILE_ROWS`. XLA:CPU's
  ragged_dot costs more than running every expert on every token (measured on a 2-core CPU, 8 experts,
  top-2, hidden 512 x 1024, 512 pairs: ragged_dot 31 ms, all experts dense 17 ms, this loop 8 ms).
- "dense": every expert on every token, weighted by the routing (zero where not chosen): the plain
  reference the others are tested against, and the baseline of `python -m benchmarks.moe`.

"auto" is ragged_dot on GPU and TPU, the loop elsewhere.

Expert parallelism: on a mesh the experts split over the model axis (`w_experts_*` sharded on their
first axis); routing is replicated, each device runs the pairs routed to its own experts (the others
sort past its groups and add nothing) and the partial outputs are summed over the devices.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MOE_IMPLS = ("auto", "ragged_dot", "loop", "dense")
TILE_ROWS = 16


def resolve_moe_impl(name: str, platform: str | None = None) -> str:
    if name not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {', '.join(MOE_IMPLS)}, got {name!r}")
    if name != "auto":
        return name
    platform = platform or jax.devices()[0].platform
    return "ragged_dot" if platform in ("gpu", "cuda", "rocm", "tpu") else "loop"


def activation(name: str, x: jax.Array) -> jax.Array:
    """The MLP's activation (in f32): silu (SwiGLU), gelu_tanh (GeGLU, GPT-2: the tanh-approximated gelu), gelu
    (exact: GPT-NeoX), relu (OPT), relu2 (its square: Nemotron, Arcee)."""
    x32 = x.astype(jnp.float32)
    if name == "quick_gelu":   # (CLIP's vision tower)
        return x32 * jax.nn.sigmoid(1.702 * x32)
    if name in ("relu", "relu2"):
        return jax.nn.relu(x32) ** (2 if name == "relu2" else 1)
    return jax.nn.silu(x32) if name == "silu" else jax.nn.gelu(x32, approximate=name == "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a token chooses its experts, as transformers' routers do (static: part of the compiled step).

    scores: softmax of the router logits, or their sigmoid (DeepSeek-V3, GLM-4.5: a correction bias added
    to the scores steers which experts are chosen, not their weights). groups (n, kept): the experts in n
    equal groups, each scored by its best expert ("max", DeepSeek-V2) or its two best summed ("top2", V3),
    and only the `kept` best groups' experts are chosen from. The k chosen scores are renormalized to sum
    to 1 where `normalize`, then times `scale` (routed_scaling_factor)."""
    top_k: int
    normalize: bool = False
    scoring: str = "softmax"
    groups: tuple[int, int] = (1, 1)
    group_score: str = "max"
    scale: float = 1.0

    @classmethod
    def of(cls, cfg) -> "Routing":
        """A ModelConfig's router."""
        return cls(cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.router_scoring, cfg.router_groups,
                   cfg.router_group_score, cfg.routed_scaling_factor)


def route(x: jax.Array, router: jax.Array, routing: Routing, bias: jax.Array | None = None,
          correction: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(weights [tokens, k] in x's dtype, expert ids i32[tokens, k]) as `routing` says; `bias` (gpt-oss)
    joins the logits, `correction` (DeepSeek-V3's e_score_correction_bias) the scores the choice is made on.
    The logits come from f32 operands for every family: transformers keeps DeepSeek's and GLM's gates in
    f32, and runs Mixtral's, Qwen's and gpt-oss's in the model dtype (in bfloat16 a near-tied choice may then
    differ from transformers'; the f32 one is the more exact, and the matmul is [hidden, experts] small)."""
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if routing.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if correction is None else scores + correction.astype(jnp.float32)
    groups, kept = routing.groups
    if groups > 1:
        grouped = choice.reshape(choice.shape[0], groups, -1)
        group_scores = (grouped.max(-1) if routing.group_score == "max"
                        else jax.lax.top_k(grouped, 2)[0].sum(-1))                    # [tokens, groups]
        _, best = jax.lax.top_k(group_scores, kept)
        keep = jnp.zeros(group_scores.shape, jnp.bool_).at[jnp.arange(choice.shape[0])[:, None], best].set(True)
        # DeepSeek-V2 zeroes the other groups' scores, V3 sets them to -inf: the same choice among kept ones
        choice = jnp.where(jnp.repeat(keep, choice.shape[1] // groups, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, routing.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if routing.normalize:   # (the epsilon: transformers' DeepSeek-V3 and GLM, below f32's resolution of other sums)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return (weights * routing.scale).astype(x.dtype), ids.astype(jnp.int32)


def _gated(h: jax.Array, act) -> jax.Array:
    """act(gate) * up of h = gate | up; `act` a hidden_act name, or ("swiglu_clamped", limit, alpha):
    gpt-oss's (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)."""
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter], h[..., inter:].astype(jnp.float32)
    if isinstance(act, tuple):
        _, limit, alpha = act
        g = jnp.minimum(gate.astype(jnp.float32), limit)
        return ((jnp.clip(up, -limit, limit) + 1.0) * g * jax.nn.sigmoid(alpha * g)).astype(h.dtype)
    return (activation(act, gate) * up).astype(h.dtype)


def _loop_mlp(rows: jax.Array, group_sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, act, b_gate_up,
              b_down):
    """Each expert's contiguous rows in tiles: a tile past its expert's rows reads the next expert's
    (or padding) and keeps the values already there."""
    num_rows, hidden = rows.shape
    padded = jnp.concatenate([rows, jnp.zeros((TILE_ROWS, hidden), rows.dtype)])
    starts = jnp.cumsum(group_sizes) - group_sizes
    tile = jnp.arange(TILE_ROWS, dtype=jnp.int32)

    def per_expert(out, xs):
        w_gu, w_dn, start, size, *biases = xs   # biases: this expert's (gpt-oss), or none

        def per_tile(t, out):
            first = start + t * TILE_ROWS
            h = jax.lax.dynamic_slice_in_dim(padded, first, TILE_ROWS) @ w_gu
            if biases:
                h = h + biases[0]
            y = _gated(h, act) @ w_dn
            if biases:
                y = y + biases[1]
            keep = (tile < size - t * TILE_ROWS)[:, None]
            old = jax.lax.dynamic_slice_in_dim(out, first, TILE_ROWS)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y.astype(out.dtype), old), first, 0)

        return jax.lax.fori_loop(0, (size + TILE_ROWS - 1) // TILE_ROWS, per_tile, out), None

    biases = () if b_gate_up is None else (b_gate_up, b_down)
    out, _ = jax.lax.scan(per_expert, jnp.zeros((num_rows + TILE_ROWS, hidden), rows.dtype),
                          (w_gate_up, w_down, starts, group_sizes, *biases))
    return out[:num_rows]


def expert_mlp(rows: jax.Array, group_sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, act,
               impl: str, b_gate_up: jax.Array | None = None, b_down: jax.Array | None = None) -> jax.Array:
    """rows [R, hidden] sorted by expert, group_sizes i32[experts] -> [R, hidden], row r through its own
    expert's gated MLP (rows past the groups' sum: whatever, their callers drop them). impl: "ragged_dot"
    or "loop"; b_gate_up / b_down: the experts' biases (gpt-oss) or None."""
    if impl == "ragged_dot":
        h = jax.lax.ragged_dot(rows, w_gate_up, group_sizes)
        if b_gate_up is None:
            return jax.lax.ragged_dot(_gated(h, act), w_down, group_sizes)
        ends = jnp.cumsum(group_sizes)
        expert = jnp.clip(jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right"), 0, len(group_sizes) - 1)
        return jax.lax.ragged_dot(_gated(h + b_gate_up[expert], act), w_down, group_sizes) + b_down[expert]
    if impl == "loop":
        return _loop_mlp(rows, group_sizes, w_gate_up, w_down, act, b_gate_up, b_down)
    raise ValueError(f"expert_mlp impl must be ragged_dot or loop, got {impl!r}")


def _dense_moe(x, weights, ids, w_gate_up, w_down, act, first_expert, *biases):
    """Every (local) expert on every token, weighted by the routing (0 where not chosen)."""
    num_local = w_gate_up.shape[0]
    local = jnp.arange(num_local, dtype=jnp.int32) + first_expert
    gate = jnp.sum(jnp.where(ids[:, :, None] == local[None, None, :], weights[:, :, None], 0), axis=1)   # [T, E]
    h = jnp.einsum("td,edi->eti", x, w_gate_up)
    if biases:
        h = h + biases[0][:, None, :]
    y = jnp.einsum("eti,eid->etd", _gated(h, act), w_down)
    if biases:
        y = y + biases[1][:, None, :]
    return jnp.einsum("etd,te->td", y.astype(jnp.float32), gate.astype(jnp.float32)).astype(x.dtype)


def _sparse_moe(x, weights, ids, w_gate_up, w_down, act, first_expert, *biases, impl):
    num_tokens, k = ids.shape
    num_local = w_gate_up.shape[0]
    expert = ids.reshape(-1) - first_expert                                    # [T * k]
    is_local = (expert >= 0) & (expert < num_local)
    key = jnp.where(is_local, expert, num_local)                               # other devices' experts last
    order = jnp.argsort(key, stable=True)
    token = order // k
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    y = expert_mlp(x[token], group_sizes, w_gate_up, w_down, act, impl, *biases)   # [T * k, hidden]
    pair_weight = jnp.where(is_local[order], weights.reshape(-1)[order], 0).astype(jnp.float32)
    y = jnp.where(is_local[order][:, None], y.astype(jnp.float32), 0.0) * pair_weight[:, None]
    return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token].add(y).astype(x.dtype)


def moe_mlp(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, routing: Routing,
            act, impl: str, plan=None, router_bias: jax.Array | None = None,
            router_correction: jax.Array | None = None, b_gate_up: jax.Array | None = None,
            b_down: jax.Array | None = None) -> jax.Array:
    """x [tokens, hidden] -> the routed experts' weighted sum [tokens, hidden]. `plan` (a ShardPlan
    with a mesh): the experts are sharded over its model axis (expert parallelism). `act`: see _gated;
    the biases (gpt-oss): the router's [experts] and the experts' (module docstring), or None;
    `router_correction` [experts]: the choice bias of DeepSeek-V3, GLM or ERNIE MoE (`route`), or None."""
    weights, ids = route(x, router, routing, router_bias, router_correction)
    biases = () if b_gate_up is None else (b_gate_up, b_down)
    fn = _dense_moe if impl == "dense" else functools.partial(_sparse_moe, impl=impl)
    if plan is None or plan.mesh is None:
        return fn(x, weights, ids, w_gate_up, w_down, act, 0, *biases)
    from jaxpaged.parallel import MODEL_AXIS

    def per_shard(x, weights, ids, w_gate_up, w_down, *biases):
        first = jax.lax.axis_index(MODEL_AXIS) * w_gate_up.shape[0]
        return jax.lax.psum(fn(x, weights, ids, w_gate_up, w_down, act, first, *biases), MODEL_AXIS)

    experts = P(MODEL_AXIS, None, None)
    return jax.shard_map(per_shard, mesh=plan.mesh,
                         in_specs=(P(), P(), P(), experts, experts) + (P(MODEL_AXIS, None),) * len(biases),
                         out_specs=P(), check_vma=False)(x, weights, ids, w_gate_up, w_down, *biases)
