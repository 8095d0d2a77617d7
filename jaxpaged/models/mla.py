"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash), computed over its compressed latent.

Each token's keys and values come from one small vector: the latent c = norm(x @ W_kv_a)[:kv_lora_rank]
(512 dims in DeepSeek-V3) and a rotating key k_pe = rope((x @ W_kv_a)[kv_lora_rank:]) (64 dims) that
every head shares. transformers expands c into per-head keys and values (kv_b_proj); here the
expansion is folded into the queries and the output instead, as vLLM does ("weight absorption"):

    q_nope . (c @ W_uk[h])  =  (q_nope @ W_uk[h]^T) . c        W_uk, W_uv: kv_b_proj's per-head halves
    softmax(...) @ (c @ W_uv[h])  =  (softmax(...) @ c) @ W_uv[h]

so attention runs as multi-query attention over one "KV head" of kv_lora_rank + rotary_dim dims: the
query [q_nope @ W_uk^T | rope(q_pe)] against the key [c | k_pe], and the values are the same vectors
(the output's first kv_lora_rank dims are softmax @ c; the last rotary_dim are dropped). The KV pool
holds that one vector per token and layer (ModelConfig: head_dim = kv_lora_rank + rotary_dim,
num_kv_heads = 1), written to both of its K and V planes so that every attention backend runs it
unchanged: 2 x 576 values a token and layer for DeepSeek-V3 where the expanded keys and values would
take 128 heads x (192 + 128). (A pool with one plane for latent models would halve it again: not built.)

Weights, ours ([in, out] as every matmul weight here): wq [hidden, heads x (nope + rope)], or the
low-rank wq_a [hidden, q_lora_rank] -> q_a_norm -> wq_b; wkv_a [hidden, kv_lora_rank + rope],
kv_a_norm [kv_lora_rank]; w_uk [heads, kv_lora_rank, nope], w_uv [heads, kv_lora_rank, v_head_dim]
(both sliced from kv_b_proj by the loader, `split_kv_b`); wo [heads x v_head_dim, hidden]. With tensor
parallelism the heads split (wq / wq_b columns, w_uk / w_uv, wo rows) and the latent's projection is
replicated: each device keeps its copy of the latent in its own KV head of the pool.
"""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpaged.models.rope import apply_rotary
from jaxpaged.parallel import MODEL_AXIS

# our weight name -> the Hugging Face attention tensor it is read from ("self_attn." + this); w_uk and
# w_uv are kv_b_proj's halves, served by the reader under these names (hf_names.hf_reader)
SOURCES = {"wq": "q_proj.weight", "wq_a": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight",
           "wq_b": "q_b_proj.weight", "wkv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
           "w_uk": "kv_b_proj.uk", "w_uv": "kv_b_proj.uv", "wo": "o_proj.weight"}
KV_B_PARTS = ("kv_b_proj.uk", "kv_b_proj.uv")
# the query's and the latent's norms' epsilon: transformers (and DeepSeek's own code) build q_a_layernorm and
# kv_a_layernorm with the RMSNorm default whatever rms_norm_eps says (GLM-4.7-Flash's 1e-5)
LATENT_NORM_EPS = 1e-6


def weight_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """name -> shape of one layer's attention weights."""
    d, h, lora, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.rotary_dim
    q_out = h * (cfg.qk_nope_head_dim + rope)
    shapes = ({"wq_a": (d, cfg.q_lora_rank), "q_a_norm": (cfg.q_lora_rank,), "wq_b": (cfg.q_lora_rank, q_out)}
              if cfg.q_lora_rank else {"wq": (d, q_out)})
    shapes.update(wkv_a=(d, lora + rope), kv_a_norm=(lora,), w_uk=(h, lora, cfg.qk_nope_head_dim),
                  w_uv=(h, lora, cfg.v_head_dim), wo=(h * cfg.v_head_dim, d))
    return shapes


def split_kv_b(cfg, tensor: np.ndarray, part: str) -> np.ndarray:
    """kv_b_proj.weight [heads x (nope + v), kv_lora_rank] -> its per-head key half [heads, nope, lora]
    ("kv_b_proj.uk") or value half [heads, v, lora] ("kv_b_proj.uv"), PyTorch's [.., out, in]."""
    per_head = tensor.reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return per_head[:, :cfg.qk_nope_head_dim] if part.endswith("uk") else per_head[:, cfg.qk_nope_head_dim:]


def rotate_half_order(cfg, name: str, tensor: np.ndarray) -> np.ndarray:
    """An interleaved rope's rotating output rows of q_proj / q_b_proj (the last rotary_dim of each head)
    and kv_a_proj_with_mqa (its last rotary_dim) reordered as rotate-half's (evens, then odds): q . k is
    unchanged and the model's rotate-half rope turns the pairs the checkpoint's does (an FP8 checkpoint's
    reordered in float). Others as they are."""
    rope, nope, lora = cfg.rotary_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    half = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        rows, per_head = np.concatenate([np.arange(nope), nope + half]), nope + rope
    elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        rows, per_head = np.concatenate([np.arange(lora), lora + half]), lora + rope
    else:
        return tensor
    if hasattr(tensor, "as_float"):   # a pre-quantized checkpoint's (HostQuantized)
        tensor = tensor.as_float()
    return tensor.reshape(-1, per_head, tensor.shape[-1])[:, rows].reshape(tensor.shape)


def mla_attention(cfg, plan, matmul, norm, w, x, cos, sin, attend):
    """x [tokens, hidden] -> the attention block's output [tokens, hidden]. `norm(x, weight)` is the model's
    RMSNorm at LATENT_NORM_EPS; `attend(q, k, v)` writes k / v into this layer's pool plane and attends q over it
    ([tokens, heads, dim] -> [tokens, heads, dim]); cos / sin: the layer's rope."""
    num_tokens = x.shape[0]
    heads, nope, lora = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    by_head = P(None, MODEL_AXIS, None)
    if cfg.q_lora_rank:
        q = matmul(norm(matmul(x, w["wq_a"], "wq_a"), w["q_a_norm"]), w["wq_b"], "wq_b")
    else:
        q = matmul(x, w["wq"], "wq")
    q = plan.constrain(q.reshape(num_tokens, heads, -1), by_head)
    kv = matmul(x, w["wkv_a"], "wkv_a")                                       # [tokens, lora + rope]
    latent = norm(kv[:, :lora], w["kv_a_norm"])
    k_pe = apply_rotary(kv[:, None, lora:], cos, sin)                          # [tokens, 1, rope]
    q_latent = jnp.einsum("thn,hcn->thc", q[..., :nope], w["w_uk"])           # [tokens, heads, lora]
    query = jnp.concatenate([q_latent, apply_rotary(q[..., nope:], cos, sin)], axis=-1)
    key = jnp.concatenate([latent[:, None, :], k_pe], axis=-1)                # [tokens, 1, lora + rope]
    # one copy per device where tensor parallelism repeats the KV head (cfg: the sharded config)
    key = plan.constrain(jnp.broadcast_to(key, (num_tokens, cfg.num_kv_heads, key.shape[-1])), by_head)
    attn = attend(query, key, key)
    out = jnp.einsum("thc,hcv->thv", attn[..., :lora], w["w_uv"]).reshape(num_tokens, heads * cfg.v_head_dim)
    return matmul(out, w["wo"], "wo")

