"""Hugging Face tensor names -> our layer weights: which checkpoint tensors make each engine weight
(`_hf_layer_sources`, Llama-style names for every family), the reader that serves those names from
a family's own layout (`hf_reader`: Phi-3's fused tensors, Mixtral's, Granite MoE's and ERNIE MoE's names,
expert stacks, DeepSeek's kv_b_proj halves, a vision-language checkpoint's language model), and the
shape and orientation of each part (PyTorch [out, in] -> our [in, out])."""

import re
from typing import Callable

import numpy as np

from jaxpaged.models import gpt_families, mla
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import weight_shapes
from jaxpaged.models.families import ERNIE_MOE, FUSED_LINEARS, GRANITE_MOE, MINIMAX_M2
from jaxpaged.models.prequantized import mxfp4_dequantize
from jaxpaged.models.quantization import HostQuantized


def hf_top_sources(cfg: ModelConfig) -> dict[str, str]:
    """Our weight name -> the Hugging Face tensor of the weights outside the layers (`llama.weight_shapes`):
    the embedding, the final norm (and its bias), the learned positions, the LM head ([out, in]: transposed)
    and its bias, a classifier's score head."""
    sources = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
               "final_norm_bias": "model.norm.bias", "pos_embed": "model.embed_positions.weight",
               "lm_head": "lm_head.weight", "lm_head_bias": "lm_head.bias", "classifier": "score.weight"}
    return {name: hf for name, hf in sources.items() if name in weight_shapes(cfg)}


def linear_rows(cfg: ModelConfig, linear: str) -> int:
    """The output rows of a Llama-style dense linear (a part of a fused one: `families.FUSED_LINEARS`)."""
    if linear.startswith("self_attn."):
        return cfg.q_size if linear.endswith("q_proj") else cfg.kv_size
    return cfg.intermediate_size


def _hf_layer_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Our layer weight name -> the Hugging Face tensors (concatenated on the output dim) of layer i.

    The names are the Llama-style ones every family is read through (`hf_reader` serves them from a
    Phi-3 or Mixtral checkpoint); an MoE layer's experts are read as stacks [experts, out, in]
    ("mlp.experts.gate_proj.weight", ...), also served by `hf_reader`."""
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    moe = cfg.is_moe_layer(i)
    # Qwen2-MoE's gated shared_expert, DeepSeek's and GLM's shared_experts (several fused in one MLP)
    dense = (mlp + ("shared_expert." if cfg.shared_expert_gated else "shared_experts.")) if moe else mlp
    sources = {}
    # the norms after attention and the MLP (sandwich_norms), and the one before the MLP: Gemma's names, or GLM-4's
    glm4 = cfg.architecture == "Glm4ForCausalLM"
    attn_out, mlp_out = ("post_self_attn_layernorm", "post_mlp_layernorm") if glm4 else \
        ("post_attention_layernorm", "post_feedforward_layernorm")
    if cfg.pre_norms:   # (OLMo has only the sandwich norms after attention and the MLP; Cohere one before both)
        sources["input_norm"] = [p + "input_layernorm.weight"]
    if cfg.pre_norms and (cfg.parallel_mlp_norm or not cfg.parallel_block):
        sources["post_norm"] = [p + ("pre_feedforward_layernorm.weight" if cfg.sandwich_norms and not glm4
                                     else "post_attention_layernorm.weight")]
    if cfg.norm_bias:   # (the LayerNorm families': GPT-2's, StableLM's, ...)
        sources.update({f"{name}_bias": [hf[0].replace(".weight", ".bias")] for name, hf in list(sources.items())})
    if cfg.is_mla:
        sources.update({name: [attn + mla.SOURCES[name]] for name in mla.weight_shapes(cfg)})
    else:
        sources["wqkv"] = [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"]
        sources["wo"] = [attn + "o_proj.weight"]
    if not cfg.gated_mlp:
        sources["w_up"] = [mlp + "up_proj.weight"]
        sources["w_down"] = [mlp + "down_proj.weight"]
    elif not moe or cfg.shared_expert_size:
        sources["w_gate_up"] = [dense + "gate_proj.weight", dense + "up_proj.weight"]
        sources["w_down"] = [dense + "down_proj.weight"]
    if moe:
        sources["router"] = [mlp + "gate.weight"]
        sources["w_experts_gate_up"] = [mlp + "experts.gate_proj.weight", mlp + "experts.up_proj.weight"]
        sources["w_experts_down"] = [mlp + "experts.down_proj.weight"]
        if cfg.shared_expert_gated:
            sources["shared_gate"] = [mlp + "shared_expert_gate.weight"]
        if cfg.router_choice_bias:
            sources["router_correction"] = [mlp + "gate.e_score_correction_bias"]
        if cfg.moe_bias:
            sources["router_bias"] = [mlp + "gate.bias"]
            sources["b_experts_gate_up"] = [mlp + "experts.gate_proj.bias", mlp + "experts.up_proj.bias"]
            sources["b_experts_down"] = [mlp + "experts.down_proj.bias"]
    if cfg.attn_sinks:
        sources["sinks"] = [attn + "sinks"]
    if cfg.sandwich_norms:
        sources["attn_out_norm"] = [p + attn_out + ".weight"]
        sources["mlp_out_norm"] = [p + mlp_out + ".weight"]
    if cfg.qkv_bias:
        sources["bqkv"] = [attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"]
    if cfg.o_bias:
        sources["bo"] = [attn + "o_proj.bias"]
    if cfg.mlp_bias:
        sources.update({"b_gate_up": [dense + "gate_proj.bias", dense + "up_proj.bias"]} if cfg.gated_mlp
                       else {"b_up": [mlp + "up_proj.bias"]})
        sources["b_down"] = [dense + "down_proj.bias"]
    if cfg.qk_norm:
        sources["q_norm"] = [attn + "q_norm.weight"]
        sources["k_norm"] = [attn + "k_norm.weight"]
    return sources


# our names of the expert stacks: sharded by expert (not by columns), never quantized; their biases
# [experts, out] (gpt-oss) are stacks of vectors, never transposed
EXPERT_BIASES = ("b_experts_gate_up", "b_experts_down")
EXPERT_WEIGHTS = ("w_experts_gate_up", "w_experts_down") + EXPERT_BIASES
# held in f32 whatever the model's dtype: the expert-choice bias of DeepSeek-V3, GLM and ERNIE MoE (transformers
# and vLLM keep it in f32: its entries differ in the third digit, which bfloat16 would round away)
F32_WEIGHTS = ("router_correction",)
# the matmul weights `quantization` applies to (routers and gates stay in the model dtype)
QUANTIZABLE = ("wqkv", "wo", "w_gate_up", "w_up", "w_down")
_MIXTRAL_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_EXPERT_STACK = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
GPT_OSS = "GptOssForCausalLM"


def hf_reader(cfg: ModelConfig, get: Callable[[str], np.ndarray],
              has: Callable[[str], bool]) -> tuple[Callable[[str], np.ndarray], Callable[[str], bool]]:
    """(get, has) that also serve `_hf_layer_sources`' names from the checkpoint's own layout: Phi-3's
    fused qkv_proj and gate_up_proj (sliced; GLM-4's gate_up_proj), Mixtral's and MiniMax-M2's block_sparse_moe
    names, and expert stacks [experts, out, in] (stacked from per-expert tensors, or sliced from transformers 5's fused
    `experts.gate_up_proj` [experts, 2 x inter, hidden] / `experts.down_proj`; gpt-oss's fused
    [experts, in, out] with gate and up interleaved, its `mlp.router` and the experts' bias stacks; Granite
    MoE's block_sparse_moe, router and shared_mlp; ERNIE MoE's moe_statics), kv_b_proj's per-head halves for
    latent attention (`mla.split_kv_b`), an interleaved rope's q/k rows reordered (`_rotate_half_order`), and a
    vision-language checkpoint's language model under a causal LM's names (`_language_model_names`)."""
    arch = cfg.architecture
    if arch in gpt_families.ARCHITECTURES:
        get, has = gpt_families.reader(cfg, get, has)
    get, has = _language_model_names(get, has)

    def source(name: str):
        """name -> (real tensor name, slice of its rows or None), or None where it has no other source."""
        if name.startswith("model.") and not has(name) and has(name[len("model."):]):   # a bare *Model's
            return name[len("model."):], None
        for fused, parts in FUSED_LINEARS.get(arch, {}).items():   # Phi-3's qkv_proj and gate_up_proj, GLM's
            for j, part in enumerate(parts):
                if name.endswith(f".{part}.weight"):
                    rows = [linear_rows(cfg, p) for p in parts]
                    return name.replace(part, fused), (sum(rows[:j]), sum(rows[:j + 1]))
        if arch == GPT_OSS and ".mlp.gate." in name:
            return name.replace(".mlp.gate.", ".mlp.router."), None
        if arch in GRANITE_MOE:
            return _granite_moe_source(cfg, name, has)
        if arch == ERNIE_MOE and name.endswith(".mlp.gate.e_score_correction_bias"):   # [1, experts] as released
            released = name.replace(".mlp.gate.", ".mlp.moe_statics.")
            return (released if has(released) else name.replace(".gate.", ".gate.moe_statics.")), None
        if arch == MINIMAX_M2 and name.endswith(".mlp.gate.e_score_correction_bias"):   # beside the router
            saved = name.replace(".mlp.gate.", ".mlp.")   # transformers' name; as released, block_sparse_moe's
            return (saved if has(saved) else saved.replace(".mlp.", ".block_sparse_moe.")), None
        if arch in ("MixtralForCausalLM", MINIMAX_M2) and ".mlp." in name:
            moe = name.replace(".mlp.", ".block_sparse_moe.")
            for ours, theirs in _MIXTRAL_EXPERT.items():
                moe = moe.replace(f".{ours}.", f".{theirs}.")
            return moe, None
        return None

    def get_one(name: str) -> np.ndarray:
        if has(name):
            return get(name)
        found = source(name)
        if found is None:
            return get(name)
        real, rows = found
        tensor = get(real)
        if rows is None:
            return tensor
        if isinstance(tensor, HostQuantized):   # a pre-quantized fused tensor: sliced in float
            tensor = tensor.as_float()
        return tensor[rows[0]:rows[1]]

    def has_one(name: str) -> bool:
        return has(name) or (source(name) is not None and has(source(name)[0]))

    def stack(name: str):
        """An expert stack's (prefix, part, transformers 5's fused name), or None for another tensor."""
        match = _EXPERT_STACK.match(name)
        if match is None:
            return None
        prefix, part, kind = match.groups()
        fused = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
        if arch in GRANITE_MOE:   # block_sparse_moe.experts.*, or the released input_linear / output_linear
            moe = prefix.replace(".mlp.experts", ".block_sparse_moe")
            fused = fused.replace(".mlp.experts.", ".block_sparse_moe.experts.")
            if not has(fused):
                fused = f"{moe}.{'output_linear' if part == 'down_proj' else 'input_linear'}.weight"
        return prefix, part, fused + ("_bias" if kind == "bias" else "")

    decoded: dict[str, np.ndarray] = {}   # the last MXFP4 tensor de-quantized (gpt-oss), by name

    def get_any(name: str) -> np.ndarray:
        if cfg.is_mla and name.endswith(mla.KV_B_PARTS):   # kv_b_proj's per-head key or value half
            tensor = get_one(name.rpartition(".")[0] + ".weight")   # (an FP8 checkpoint's: sliced in float)
            return mla.split_kv_b(cfg, tensor.as_float() if isinstance(tensor, HostQuantized) else tensor, name)
        found = stack(name)
        if found is None:
            tensor = get_one(name)
            if name.endswith("e_score_correction_bias"):   # ERNIE's [1, experts]
                return tensor.reshape(-1)
            return _rotate_half_order(cfg, name, tensor) if cfg.rope_interleaved else tensor
        prefix, part, fused = found
        if arch == GPT_OSS and not has(fused) and has(fused + "_blocks"):   # MXFP4: [experts, out, in]
            if fused not in decoded:   # gate and up are read in turn from one fused tensor: decode it once
                decoded.clear()
                decoded[fused] = mxfp4_dequantize(get(fused + "_blocks"), get(fused + "_scales"))
            tensor = decoded[fused]
            return tensor if part == "down_proj" else tensor[:, (part == "up_proj")::2]
        if arch == GPT_OSS:   # [experts, in, out] (a bias [experts, out]), gate and up columns interleaved
            tensor = get(fused)
            if part != "down_proj":
                tensor = tensor[..., (part == "up_proj")::2]
            return tensor if fused.endswith("_bias") else np.swapaxes(tensor, 1, 2)
        if has(fused):   # transformers 5's own layout: [experts, 2 x inter, hidden] (gate | up) or down
            tensor = get(fused)
            if part == "down_proj":
                return tensor
            inter = tensor.shape[1] // 2
            return tensor[:, :inter] if part == "gate_proj" else tensor[:, inter:]
        experts = [get_one(f"{prefix}.{e}.{part}.weight") for e in range(cfg.num_experts)]
        # pre-quantized experts (an fp8 checkpoint's) are stacked in float: experts stay unquantized
        return np.stack([p.as_float() if isinstance(p, HostQuantized) else p for p in experts])

    def has_any(name: str) -> bool:
        if cfg.is_mla and name.endswith(mla.KV_B_PARTS):
            return has_one(name.rpartition(".")[0] + ".weight")
        found = stack(name)
        if found is None:
            return has_one(name)
        prefix, part, fused = found
        return has(fused) or has(fused + "_blocks") or all(has_one(f"{prefix}.{e}.{part}.weight")
                                                           for e in range(cfg.num_experts))

    return get_any, has_any


def _granite_moe_source(cfg: ModelConfig, name: str, has) -> tuple[str, tuple[int, int] | None] | None:
    """Granite MoE's names for ours: the router (block_sparse_moe.router.weight, or router.layer.weight as
    released) and GraniteMoeShared's and Granite 4's shared MLP (shared_mlp.input_linear = gate | up,
    output_linear; a dense Granite 4's MLP)."""
    if ".mlp.gate." in name:
        router = name.replace(".mlp.gate.", ".block_sparse_moe.router.")
        return (router if has(router) else router.replace(".router.", ".router.layer.")), None
    inter = cfg.shared_expert_size or cfg.intermediate_size   # (a dense Granite 4's MLP is its shared_mlp)
    for part, real, rows in (("gate_proj", "input_linear", (0, inter)), ("up_proj", "input_linear", (inter, 2 * inter)),
                             ("down_proj", "output_linear", None)):
        for ours in (f".mlp.shared_experts.{part}.", f".mlp.{part}."):
            if name.endswith(ours + "weight"):
                return name.replace(ours, f".shared_mlp.{real}."), rows
    return None


def _language_model_names(get, has):
    """(get, has) that serve a vision-language checkpoint's language model under a causal LM's names:
    "model.language_model.X" (transformers 5's layout) or "language_model.model.X" with its
    "language_model.lm_head" (earlier saves) for "model.X" and "lm_head"; other checkpoints as they are."""
    for prefix, head in (("model.language_model.", "lm_head."), ("language_model.model.", "language_model.lm_head.")):
        if not has("model.embed_tokens.weight") and has(prefix + "embed_tokens.weight"):
            def rename(name: str, prefix=prefix, head=head) -> str:
                if name.startswith("model."):
                    return prefix + name[len("model."):]
                return head + name[len("lm_head."):] if name.startswith("lm_head.") else name
            return (lambda name: get(rename(name))), (lambda name: has(rename(name)))
    return get, has


_ROTATING = re.compile(r"self_attn\.(q|k)_(proj|norm)\.(weight|bias)$")


def _rotate_half_order(cfg: ModelConfig, name: str, tensor):
    """q/k's dims of an interleaved rope's model (ERNIE: pairs (2i, 2i+1) turn together) reordered, head by
    head, as rotate-half's (pair (i, i + rotary / 2)): q . k is the same, and the model's rope turns the
    same pairs by the same angles (latent attention: `mla.rotate_half_order`). Other tensors as they are."""
    if cfg.is_mla:
        return mla.rotate_half_order(cfg, name, tensor)
    match = _ROTATING.search(name)
    if match is None:
        return tensor
    return rotate_half_rows(cfg, tensor.as_float() if isinstance(tensor, HostQuantized) else tensor)


def rotate_half_rows(cfg: ModelConfig, tensor: np.ndarray) -> np.ndarray:
    """q's or k's rows (a weight's, a bias's, a norm's, a LoRA B's) reordered head by head from an interleaved
    rope's pairs (2i, 2i + 1) to rotate-half's (i, i + rotary / 2); the dims past the rotary ones stay."""
    rot = cfg.rotary_dim or cfg.head_dim
    order = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, cfg.head_dim)])
    heads = tensor.shape[0] // cfg.head_dim
    return tensor.reshape(heads, cfg.head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)


def hf_tensor(get: Callable[[str], np.ndarray], has: Callable[[str], bool], name: str,
              shape: tuple[int, ...]) -> np.ndarray:
    """One Hugging Face tensor; ValueError naming it when it is missing or has the wrong shape."""
    if not has(name):
        raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
    tensor = get(name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")
    return tensor


def hf_part_shape(cfg: ModelConfig, name: str, ours: tuple[int, ...], parts: int, j: int) -> tuple[int, ...]:
    """PyTorch [out, in] shape of part j of our fused [in, out...] weight `name` (ours: its shape; an
    expert stack [experts, in, out] reads [experts, out, in])."""
    if name in EXPERT_BIASES:
        return (ours[0], ours[-1] // parts)
    if name in ("wqkv", "bqkv"):
        out = (cfg.q_size, cfg.kv_size, cfg.kv_size)[j]
    else:
        out = ours[-1] // parts
    if len(ours) == 3:
        return (ours[0], out, ours[1])
    return (out, ours[0]) if len(ours) == 2 else (out,)


def hf_to_ours(part, name: str = ""):
    """A PyTorch [.., out, in] linear weight as ours [.., in, out] (a bias or norm as it is; `name`, ours:
    an expert bias stack too)."""
    ndim = len(part.shape)
    if ndim < 2 or name in EXPERT_BIASES:
        return part
    return part.T if ndim == 2 else np.swapaxes(part, -1, -2)
