"""One Flax NNX decoder for every supported family (Llama, Mistral, Ministral, Qwen2/3, Phi-3, Gemma 1/2/3,
Granite, OLMo 2/3, SmolLM3, EXAONE 4, ERNIE 4.5, GLM-4, Seed-OSS, Cohere 1/2, StableLM, Nemotron, Arcee, GPT-2's
lineage (`jaxpaged.models.gpt_families`), and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, FlexOlmo,
gpt-oss, DeepSeek-V2/V3, GLM-4.5, MiniMax-M2): one layer body and its switches (`ModelConfig`); the rope in
`jaxpaged.models.rope`, DeepSeek's latent attention in `jaxpaged.models.mla`.

One layer body (`_decoder_layer`) and two loops over it, chosen when the model is loaded:

- scan: each layer weight stacked on a leading [num_layers] axis and a `lax.scan` over the
  stack. One layer is compiled whatever the depth: the default on every platform.
- unrolled: each layer owns its arrays and a Python loop unrolls in the jitted step. Compile
  time grows with depth (start-up about twice as long); on XLA CPU with jaxlib 0.11.2 its steps
  are about even with the scan's (docs/features.md, `scan_layers`). Layers of different shapes
  (an MoE model's dense layers, `ModelConfig.dense_layers`) can only be unrolled.

The KV pool (one array, [num_layers, 2, ...], see `jaxpaged.kernels.layout`) is threaded
through the layers whole: in the scan it is part of the carry, and the layer index, the
layer's sliding window (0 = full attention; they differ per layer in Qwen2, Gemma and OLMo 3),
whether it rotates with the local rope base (Gemma 3, OLMo 3) and whether it rotates at all (not
SmolLM3's NoPE layers) are scanned arrays. Each layer
scatters its new K/V into its own plane at that index and attends over the pool through block
tables. The scatter is in place in both loops (the step donates the pool, and a loop carry is
updated in place): no layer copies the pool.

q/k/v and gate/up are fused into one matmul each: fewer, larger matmuls. Any matmul weight may
be a `QuantizedWeight` (see `jaxpaged.models.quantization`): every matmul goes through `linear`.
A mixture-of-experts layer replaces the MLP by `jaxpaged.models.moe.moe_mlp` (plus the shared
experts of Qwen2-MoE, DeepSeek and GLM: the dense MLP's weights, Qwen2-MoE's behind a sigmoid gate).

Multi-LoRA (`lora`): every adapter slot's A and B of each projection, stacked [num_layers, slots,
...] (jaxpaged.lora.peft's layout, zeros where a slot or module is empty), and each token's slot in
the batch (`ForwardBatch.lora_index`, -1: the base model). A projection adds, for every token,
(x @ A[slot]) @ B[slot], computed for all slots and masked by the token's one-hot slot: one
compiled step whatever the mix of adapters, and a base-model token adds exact zeros.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpaged.lora.slots import lora_delta
from jaxpaged.models.batch import ForwardBatch
from jaxpaged.models.config import ModelConfig
from jaxpaged.models import mla
from jaxpaged.models.moe import Routing, activation, moe_mlp, resolve_moe_impl
from jaxpaged.models.norms import norm, rms_norm
from jaxpaged.models.quantization import QuantizedWeight, embedding_lookup, linear, matmul_kernel
from jaxpaged.models.rope import apply_rotary, mrope_cos_sin, rotary_cos_sin
from jaxpaged.parallel import MODEL_AXIS, ShardPlan
from jaxpaged.kernels import write_kv
from jaxpaged.kernels.layout import calibrated_kv_scale, is_fp8, scaled_attention
from jaxpaged.kernels.backends import get_attention


def layer_weight_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """name -> shape of layer `layer`'s weights (a scanned model stacks each on a leading [num_layers] axis;
    its layers are alike, `cfg.uniform_layers`)."""
    d, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    moe = cfg.is_moe_layer(layer)
    inter = cfg.shared_expert_size if moe else cfg.intermediate_size   # the dense MLP's (or shared expert's)
    shapes = {"input_norm": (d,), "post_norm": (d,)} if cfg.pre_norms else {}
    if cfg.parallel_block and not cfg.parallel_mlp_norm:   # one norm before attention and the MLP both
        del shapes["post_norm"]
    if cfg.norm_bias:
        shapes.update({f"{name}_bias": (d,) for name in list(shapes)})
    shapes.update(mla.weight_shapes(cfg) if cfg.is_mla else dict(wqkv=(d, q + 2 * kv), wo=(q, d)))
    if inter and not cfg.gated_mlp:   # GPT-2, OPT, Nemotron ...: up, the activation, down
        shapes["w_up"] = (d, inter)
        shapes["w_down"] = (inter, d)
    elif inter:
        shapes["w_gate_up"] = (d, 2 * inter)
        shapes["w_down"] = (inter, d)
    if moe:
        e, mi = cfg.num_experts, cfg.moe_intermediate_size
        shapes["router"] = (d, e)
        shapes["w_experts_gate_up"] = (e, d, 2 * mi)
        shapes["w_experts_down"] = (e, mi, d)
        if cfg.shared_expert_gated:
            shapes["shared_gate"] = (d, 1)
        if cfg.router_choice_bias:
            shapes["router_correction"] = (e,)
        if cfg.moe_bias:
            shapes["router_bias"] = (e,)
            shapes["b_experts_gate_up"] = (e, 2 * mi)
            shapes["b_experts_down"] = (e, d)
    if cfg.attn_sinks:
        shapes["sinks"] = (cfg.num_heads,)
    if cfg.sandwich_norms:
        shapes["attn_out_norm"] = (d,)
        shapes["mlp_out_norm"] = (d,)
    if cfg.qkv_bias:
        shapes["bqkv"] = (q + 2 * kv,)
    if cfg.o_bias:
        shapes["bo"] = (d,)
    if cfg.mlp_bias:
        shapes["b_gate_up" if cfg.gated_mlp else "b_up"] = ((2 if cfg.gated_mlp else 1) * inter,)
        shapes["b_down"] = (d,)
    if cfg.qk_norm:
        shapes["q_norm"] = (q,) if cfg.qk_norm_full else (cfg.head_dim,)
        shapes["k_norm"] = (kv,) if cfg.qk_norm_full else (cfg.head_dim,)
    return shapes


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """name -> shape of the weights outside the layers."""
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    if cfg.norm_bias:
        shapes["final_norm_bias"] = (cfg.hidden_size,)
    if cfg.learned_positions:   # GPT-2, GPT-BigCode, OPT: a row per position (OPT's from row position_offset)
        shapes["pos_embed"] = (cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    if cfg.lm_head_bias:   # Phi, GPT-J
        shapes["lm_head_bias"] = (cfg.vocab_size,)
    if cfg.num_labels:   # a classifier's head, as transformers lays it out (read on the host, ModelRunner.fetch)
        shapes["classifier"] = (cfg.num_labels, cfg.hidden_size)
    return shapes


class LlamaFamilyForCausalLM(nnx.Module):
    """Weights in our layout: `weight_shapes` at the top level and `weights["layers"]`, whose
    form picks the layer loop: a dict of stacked [num_layers, ...] arrays (`layer_weight_shapes`
    behind the layer axis) is scanned, a list of one dict per layer is unrolled."""

    def __init__(self, cfg: ModelConfig, weights: dict, attention_backend: str = "reference",
                 shard_plan: ShardPlan = ShardPlan(), quantized_matmul: str = "auto", moe_impl: str = "auto"):
        self.config = cfg
        self.attention_backend = attention_backend   # a resolved name (see jaxpaged.kernels.backends)
        self.shard_plan = shard_plan                 # the devices the weights lie on (jaxpaged.parallel)
        self.quantized_matmul = quantized_matmul     # a quantized decode matmul's kernel (quantization.matmul_kernel)
        # an MoE layer's grouped matmul (jaxpaged.models.moe)
        self.moe_impl = resolve_moe_impl(moe_impl, shard_plan.devices[0].platform)
        self.dtype = weights["final_norm"].dtype   # the activations' (norms are never quantized)
        self.embed = nnx.Param(weights["embed"])   # [vocab, hidden], or a QuantizedWeight [hidden, vocab]
        self.final_norm = nnx.Param(weights["final_norm"])
        self.final_norm_bias = nnx.Param(weights["final_norm_bias"]) if cfg.norm_bias else None
        self.pos_embed = nnx.Param(weights["pos_embed"]) if cfg.learned_positions else None   # GPT-2's, OPT's
        self.lm_head = nnx.Param(weights["lm_head"]) if "lm_head" in weights else None
        self.lm_head_bias = nnx.Param(weights["lm_head_bias"]) if cfg.lm_head_bias else None
        # a sequence classifier's `score` head [num_labels, hidden]; the step never reads it (pooling.py)
        self.classifier = nnx.Param(weights["classifier"]) if "classifier" in weights else None
        # f32[num_layers, 2]: each layer's K and V scale in an fp8 KV pool (stored = value / scale); unused
        # by a pool in the model dtype. 1.0 unless calculate_kv_scales measures them on the first step
        self.kv_scales = nnx.Param(shard_plan.put(np.ones((cfg.num_layers, 2), np.float32)))
        # LoRA stacks (jaxpaged.lora.slots), or None: an engine without enable_lora computes no LoRA
        self.lora = None
        layers = weights["layers"]
        self.scan_layers = isinstance(layers, dict)
        depths = ({leaf.shape[0] for leaf in jax.tree.leaves(layers)} if self.scan_layers else {len(layers)})
        if depths != {cfg.num_layers}:
            raise ValueError(f"layer weights hold {sorted(depths)} layers, the config {cfg.num_layers}")
        if self.scan_layers:
            self.layers = nnx.Dict({k: nnx.Param(v) for k, v in layers.items()})
        else:
            self.layers = nnx.List([nnx.Dict({k: nnx.Param(v) for k, v in layer.items()}) for layer in layers])

    def __call__(self, kv_pool: jax.Array, batch: ForwardBatch) -> tuple[jax.Array, jax.Array]:
        """Writes the batch's K/V into kv_pool and returns (kv_pool, logits f32[num_logits, vocab])."""
        kv_pool, hidden = self.hidden_states(kv_pool, batch)
        return kv_pool, self.compute_logits(hidden[batch.logits_indices])

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        cfg = self.config
        hidden = self.final_normed(hidden)
        embed = self.embed.get_value()
        if self.lm_head is not None:
            logits = self.matmul(hidden, self.lm_head.get_value(), "lm_head")
        elif isinstance(embed, QuantizedWeight):   # kept as its LM head, sharded like one
            logits = self.matmul(hidden, embed, "lm_head")
        else:
            logits = jnp.einsum("td,vd->tv", hidden, embed)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias[...]
        return _scaled_logits(cfg, logits)

    def compute_logits_transposed(self, hidden: jax.Array) -> jax.Array:
        """f32[vocab, rows]: the same logits as compute_logits, laid out vocabulary-major."""
        cfg = self.config
        hidden = self.final_normed(hidden)
        head = self.embed.get_value() if self.lm_head is None else self.lm_head.get_value()
        if isinstance(head, QuantizedWeight):
            logits = self.matmul(hidden, head, "lm_head").T
        elif self.lm_head is None:
            logits = head @ hidden.T
        else:
            logits = jnp.einsum("dv,td->vt", head, hidden)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias[...][:, None]
        return _scaled_logits(cfg, logits)

    def final_normed(self, hidden: jax.Array) -> jax.Array:
        bias = None if self.final_norm_bias is None else self.final_norm_bias[...]
        return norm(self.config, hidden, self.final_norm[...], bias)

    def matmul(self, x: jax.Array, w, name: str) -> jax.Array:
        """x @ the weight `name` (plain or quantized; a quantized decode step through the kernel, per shard)."""
        kernel = matmul_kernel(self.quantized_matmul)
        if kernel is not None and isinstance(w, QuantizedWeight):
            kernel = self.shard_plan.matmul(kernel, self.shard_plan.weight_spec(name, False))
        return linear(x, w, kernel)

    def hidden_states(self, kv_pool: jax.Array, batch: ForwardBatch) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        ids = batch.input_ids if batch.input_embeds is None else jnp.maximum(batch.input_ids, 0)
        hidden = embedding_lookup(self.embed.get_value(), ids, self.dtype)
        if cfg.embed_scale != 1.0:
            hidden = hidden * jnp.asarray(cfg.embed_scale, hidden.dtype)
        if batch.input_embeds is not None:   # prompt embeddings stand for the lookup (and its scale, unless
            given = batch.input_embeds.astype(hidden.dtype)   # the scale is the model's, as Granite's multiplier)
            if cfg.embed_scale != 1.0 and cfg.input_embeds_scaled:
                given = given * jnp.asarray(cfg.embed_scale, hidden.dtype)
            hidden = jnp.where((batch.input_ids < 0)[:, None], given, hidden)
        if self.pos_embed is not None:
            hidden = hidden + self.pos_embed[...][batch.positions + cfg.position_offset].astype(hidden.dtype)
        rope = rotary_cos_sin(cfg, batch.positions, batch.rope_lens) if batch.mrope_positions is None else \
            mrope_cos_sin(cfg, batch.mrope_positions)
        local_rope = rotary_cos_sin(cfg, batch.positions, batch.rope_lens, local=True) if cfg.local_rope_theta else rope
        lora = None if self.lora is None else {k: v.get_value() for k, v in self.lora.items()}
        onehot = None
        if lora is not None:
            slots = lora["q_a"].shape[1]
            onehot = (batch.lora_index[:, None] == jnp.arange(slots, dtype=jnp.int32)[None, :]).astype(self.dtype)
        layer_fn = functools.partial(_decoder_layer, cfg, self.shard_plan, get_attention(self.attention_backend),
                                     self.matmul, self.moe_impl, batch, rope, local_rope, onehot)
        if self.scan_layers:
            weights = {k: v.get_value() for k, v in self.layers.items()}
            xs = (weights, jnp.arange(cfg.num_layers, dtype=jnp.int32),
                  jnp.asarray(cfg.sliding_windows, jnp.int32), jnp.asarray(cfg.local_rope_layers, jnp.bool_),
                  jnp.asarray(cfg.rope_layers, jnp.bool_), self.kv_scales[...], lora)

            def scan_step(carry, xs):
                hidden, kv_pool, kv_scale = layer_fn(cfg.is_moe, *carry, *xs)
                return (hidden, kv_pool), kv_scale

            (hidden, kv_pool), kv_scales = jax.lax.scan(scan_step, (hidden, kv_pool), xs)
        else:
            used = []
            for i, layer in enumerate(self.layers):
                hidden, kv_pool, kv_scale = layer_fn(cfg.is_moe_layer(i), hidden, kv_pool,
                                                     {k: v.get_value() for k, v in layer.items()},
                                                     jnp.int32(i), jnp.int32(cfg.sliding_windows[i]),
                                                     cfg.local_rope_layers[i], cfg.rope_layers[i], self.kv_scales[i],
                                                     None if lora is None else {k: v[i] for k, v in lora.items()})
                used.append(kv_scale)
            kv_scales = jnp.stack(used)
        self.kv_scales[...] = kv_scales   # calibrated where they were 0 (see jaxpaged.kernels.layout)
        return kv_pool, hidden


def _scaled_logits(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
    """f32 logits divided by logits_scaling (Granite), then soft-capped (Gemma 2)."""
    logits = logits.astype(jnp.float32)
    if cfg.logits_scaling != 1.0:
        logits = logits / cfg.logits_scaling
    cap = cfg.final_softcap
    return logits if not cap else cap * jnp.tanh(logits / cap)


def _decoder_layer(cfg: ModelConfig, plan: ShardPlan, attention, matmul, moe_impl: str, batch: ForwardBatch, rope,
                   local_rope, onehot, moe: bool, hidden, kv_pool, w, layer, window, local, rotates, kv_scale, lora):
    """One layer (the body of both loops): (hidden, kv_pool) -> (hidden, kv_pool, kv_scale) with its K/V
    written and the K/V scales it wrote them with.

    `w` holds this layer's weights (`layer_weight_shapes`); `moe` (static) whether its MLP is a mixture of
    experts; `layer` (i32[]) is its plane of the pool, `window` (i32[]) its sliding window, 0 for full
    attention, `local` (bool) whether it rotates with `local_rope` rather than `rope` (each a (cos, sin)
    pair), `rotates` (bool) whether its q/k rotate at all (not a NoPE layer), `kv_scale` (f32[2]) its K and
    V scales in an fp8 pool; `lora` this layer's LoRA stacks (None: no LoRA) and `onehot` [tokens, slots]
    each token's adapter slot; `matmul(x, w, name)` multiplies by a weight (the model's `matmul`). The fused
    q/k/v and gate/up columns are shard-major (see jaxpaged.parallel): viewed as [tokens, tp, per shard],
    each device splits its own columns.
    """
    x = norm(cfg, hidden, w["input_norm"], w.get("input_norm_bias")) if cfg.pre_norms else hidden
    cos, sin = (jnp.where(local, a, b) for a, b in zip(local_rope, rope)) if cfg.local_rope_theta else rope
    if cfg.nope_layers:   # a NoPE layer turns by angle 0
        cos, sin = jnp.where(rotates, cos, 1.0), jnp.where(rotates, sin, 0.0)

    def attend(q, k, v):   # k / v written into this layer's plane of the pool (kv_pool updated), q attends over it
        nonlocal kv_pool, kv_scale
        if is_fp8(kv_pool.dtype):   # outside the shard_map: the largest |K| of every device's heads
            kv_scale = calibrated_kv_scale(kv_scale, k, v, batch.slot_mapping, kv_pool.dtype)

        def write_and_attend(kv_pool, q, k, v, sinks, slot_mapping, md, layer, window, kv_scale):
            kv_pool = write_kv(kv_pool, layer, k, v, slot_mapping, kv_scale)
            return kv_pool, scaled_attention(attention, q, kv_pool, layer, md, window, kv_scale,
                                             soft_cap=cfg.attn_softcap, sm_scale=cfg.attn_scale or cfg.head_dim ** -0.5,
                                             sinks=sinks)

        kv_pool, attn = plan.attention(write_and_attend)(kv_pool, q, k, v, w.get("sinks"), batch.slot_mapping,
                                                          batch.attn, layer, window, kv_scale)
        return attn

    if cfg.is_mla:
        out = mla.mla_attention(cfg, plan, matmul, lambda a, weight: rms_norm(a, weight, mla.LATENT_NORM_EPS), w, x,
                                cos, sin, attend)
    else:
        out = _attention(cfg, plan, matmul, w, x, cos, sin, attend, lora, onehot)
    if cfg.sandwich_norms:
        out = norm(cfg, out, w["attn_out_norm"])
    if cfg.parallel_block:   # Cohere: the MLP reads the attention's input too (NeoX: its own norm), both add at once
        if cfg.parallel_mlp_norm:
            x = norm(cfg, hidden, w["post_norm"], w.get("post_norm_bias"))
        mlp = _mlp(cfg, plan, matmul, w, x, moe, moe_impl, lora, onehot)
        return hidden + _residual_scaled(cfg, out) + _residual_scaled(cfg, mlp), kv_pool, kv_scale
    hidden = hidden + _residual_scaled(cfg, out)
    x = norm(cfg, hidden, w["post_norm"], w.get("post_norm_bias")) if cfg.pre_norms else hidden
    mlp = _mlp(cfg, plan, matmul, w, x, moe, moe_impl, lora, onehot)
    if cfg.sandwich_norms:
        mlp = norm(cfg, mlp, w["mlp_out_norm"])
    return hidden + _residual_scaled(cfg, mlp), kv_pool, kv_scale


def _attention(cfg: ModelConfig, plan: ShardPlan, matmul, w, x, cos, sin, attend, lora, onehot) -> jax.Array:
    """The attention block of every family but latent attention's: fused q/k/v (plus LoRA), q/k norms, rope,
    `attend` (the layer's pool write and attention), o_proj. x [tokens, hidden] -> [tokens, hidden]."""
    num_tokens, tp = x.shape[0], plan.size
    qkv = matmul(x, w["wqkv"], "wqkv")
    if cfg.qkv_bias:
        qkv = qkv + w["bqkv"]
    qkv = qkv.reshape(num_tokens, tp, -1)
    q_local, kv_local = cfg.q_size // tp, cfg.kv_size // tp
    heads = P(None, MODEL_AXIS, None)
    q = plan.constrain(qkv[..., :q_local].reshape(num_tokens, cfg.num_heads, cfg.head_dim), heads)
    k = plan.constrain(qkv[..., q_local:q_local + kv_local].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), heads)
    v = plan.constrain(qkv[..., q_local + kv_local:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), heads)
    if lora is not None:
        q = q + lora_delta(x, lora, "q", onehot).reshape(q.shape)
        k = k + lora_delta(x, lora, "k", onehot).reshape(k.shape)
        v = v + lora_delta(x, lora, "v", onehot).reshape(v.shape)
    if cfg.qk_norm_full:   # over every head at once: [tokens, heads x head_dim]
        q = norm(cfg, q.reshape(num_tokens, -1), w["q_norm"]).reshape(q.shape)
        k = norm(cfg, k.reshape(num_tokens, -1), w["k_norm"]).reshape(k.shape)
    elif cfg.qk_norm:
        q = norm(cfg, q, w["q_norm"])
        k = norm(cfg, k, w["k_norm"])
    if cfg.rotates:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    attn = attend(q, k, v)
    attn = attn.reshape(num_tokens, cfg.q_size)
    out = matmul(attn, w["wo"], "wo")
    if lora is not None:
        out = out + lora_delta(attn, lora, "o", onehot)
    return out + w["bo"] if cfg.o_bias else out


def _residual_scaled(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return x if cfg.residual_scale == 1.0 else x * jnp.asarray(cfg.residual_scale, x.dtype)


def _mlp(cfg: ModelConfig, plan: ShardPlan, matmul, w, x, moe: bool, moe_impl: str, lora, onehot):
    """The feed-forward of one layer: the gated dense MLP, or the routed experts (plus, where the
    model has one, the shared expert: the dense MLP's weights, sigmoid-gated)."""
    num_tokens, tp = x.shape[0], plan.size
    out = None
    if moe:
        out = moe_mlp(x, w["router"], w["w_experts_gate_up"], w["w_experts_down"], routing=Routing.of(cfg),
                      act=cfg.expert_act, impl=moe_impl, plan=plan, router_bias=w.get("router_bias"),
                      router_correction=w.get("router_correction"), b_gate_up=w.get("b_experts_gate_up"),
                      b_down=w.get("b_experts_down"))
    if "w_up" in w:   # not gated (GPT-2, OPT, Nemotron, ...)
        up = matmul(x, w["w_up"], "w_up") + (w["b_up"] if cfg.mlp_bias else 0)
        if lora is not None:
            up = up + lora_delta(x, lora, "up", onehot)
        act = activation(cfg.hidden_act, up).astype(up.dtype)
        dense = matmul(act, w["w_down"], "w_down")
        if lora is not None:
            dense = dense + lora_delta(act, lora, "down", onehot)
        return dense + w["b_down"] if cfg.mlp_bias else dense
    if "w_gate_up" not in w:
        return out
    inter = cfg.shared_expert_size if moe else cfg.intermediate_size
    gate_up = matmul(x, w["w_gate_up"], "w_gate_up")
    if cfg.mlp_bias:
        gate_up = gate_up + w["b_gate_up"]
    gate_up = gate_up.reshape(num_tokens, tp, -1)
    inter_local = inter // tp
    gate = gate_up[..., :inter_local].reshape(num_tokens, inter)
    up = gate_up[..., inter_local:].reshape(num_tokens, inter)
    if lora is not None:
        gate = gate + lora_delta(x, lora, "gate", onehot)
        up = up + lora_delta(x, lora, "up", onehot)
    act = activation(cfg.hidden_act, gate).astype(up.dtype) * up
    dense = matmul(act, w["w_down"], "w_down")
    if lora is not None:
        dense = dense + lora_delta(act, lora, "down", onehot)
    if cfg.mlp_bias:
        dense = dense + w["b_down"]
    if out is None:
        return dense
    if "shared_gate" not in w:   # DeepSeek's shared experts add as they are
        return out + dense
    gate = jax.nn.sigmoid((x @ w["shared_gate"]).astype(jnp.float32)).astype(dense.dtype)
    return out + gate * dense
