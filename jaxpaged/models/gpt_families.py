"""GPT-2, OPT and GPT-NeoX (Pythia): the decoders before Llama, run as switches of the same layer.

What sets them apart from Llama's layer is a handful of `ModelConfig` switches:

- LayerNorms with a bias (`layer_norm`, `norm_bias`), an MLP without a gate (`gated_mlp=False`: up, the
  activation, down), biases on the projections.
- GPT-2 and OPT: learned absolute positions added to the token embedding (`learned_positions`; OPT's table
  starts at row 2, `position_offset`), no rope.
- GPT-NeoX: a partial rotate-half rope, and (use_parallel_residual) attention and the MLP side by side
  (`parallel_block`), each on its own norm of the layer's input (`parallel_mlp_norm`).

Their configs and checkpoints have names of their own: `llama_config` gives a config the field names the
config reader reads (a copy), and `reader` serves the Llama-style tensor names the loader asks for from their
checkpoints (GPT-2's Conv1D weights, [in, out], transposed; its c_attn and NeoX's per-head query_key_value split
into q, k and v).
"""

import copy
import re
from typing import Any, Callable

import numpy as np

from jaxpaged.models.families import hf_get
from jaxpaged.models.quantization import HostQuantized

GPT2 = "GPT2LMHeadModel"
OPT = "OPTForCausalLM"
GPT_NEOX = "GPTNeoXForCausalLM"
ARCHITECTURES = (GPT2, OPT, GPT_NEOX)

# Llama-style module -> each family's name for it (a layer's, then the model's own)
_MODULES = {
    "input_layernorm": {GPT2: "ln_1", OPT: "self_attn_layer_norm", GPT_NEOX: "input_layernorm"},
    "post_attention_layernorm": {GPT2: "ln_2", OPT: "final_layer_norm", GPT_NEOX: "post_attention_layernorm"},
    "self_attn.o_proj": {GPT2: "attn.c_proj", OPT: "self_attn.out_proj", GPT_NEOX: "attention.dense"},
    "mlp.up_proj": {GPT2: "mlp.c_fc", OPT: "fc1", GPT_NEOX: "mlp.dense_h_to_4h"},
    "mlp.down_proj": {GPT2: "mlp.c_proj", OPT: "fc2", GPT_NEOX: "mlp.dense_4h_to_h"},
    "embed_tokens": {GPT2: "wte", OPT: "embed_tokens", GPT_NEOX: "embed_in"},
    "embed_positions": {GPT2: "wpe", OPT: "embed_positions"},
    "norm": {GPT2: "ln_f", OPT: "final_layer_norm", GPT_NEOX: "final_layer_norm"},
}
_FUSED_QKV = {GPT2: "attn.c_attn", GPT_NEOX: "attention.query_key_value"}   # OPT's q/k/v_proj are Llama's
# where the model's tensors lie: under its causal LM's prefix, or (a base model's save) without it
_PREFIXES = {GPT2: ("transformer.", ""), OPT: ("model.decoder.", "decoder."), GPT_NEOX: ("gpt_neox.",)}
_LAYERS = {GPT2: "h", OPT: "layers", GPT_NEOX: "layers"}
_HEADS = ("lm_head.weight", "embed_out.weight")   # NeoX's head as released: embed_out
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_TOP = re.compile(r"model\.(embed_tokens|embed_positions|norm)\.(weight|bias)$")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def llama_config(hf_config: Any, architecture: str) -> Any:
    """A copy of a GPT-2, OPT or GPT-NeoX config with the fields the config reader reads (intermediate_size,
    hidden_act, rms_norm_eps: the LayerNorms' eps, num_key_value_heads, attention_bias, mlp_bias); ValueError
    for a variant we do not run."""
    cfg = copy.deepcopy(hf_config)
    if architecture == GPT2:
        for name, unsupported in (("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True),
                                  ("add_cross_attention", True)):
            if bool(hf_get(cfg, name, not unsupported)) == unsupported:
                raise ValueError(f"{architecture} with {name}={unsupported} is not supported")
        inter, act = hf_get(cfg, "n_inner", 4 * cfg.hidden_size), cfg.activation_function
        eps, attention_bias, mlp_bias = hf_get(cfg, "layer_norm_epsilon", 1e-5), True, True
    elif architecture == OPT:
        if not hf_get(cfg, "do_layer_norm_before", True) or getattr(cfg, "_remove_final_layer_norm", False):
            raise ValueError(f"{architecture} with do_layer_norm_before=False (OPT-350m's norms after each block) is "
                             "not supported; the other OPT checkpoints norm before")
        if hf_get(cfg, "word_embed_proj_dim", cfg.hidden_size) != cfg.hidden_size:
            raise ValueError(f"{architecture} with word_embed_proj_dim ({cfg.word_embed_proj_dim}) other than "
                             f"hidden_size ({cfg.hidden_size}) is not supported (OPT-350m's projected embeddings)")
        if not hf_get(cfg, "layer_norm_elementwise_affine", True):
            raise ValueError(f"{architecture} with layer_norm_elementwise_affine=False is not supported")
        inter, act, eps = cfg.ffn_dim, cfg.activation_function, 1e-5   # (torch's LayerNorm default)
        attention_bias = mlp_bias = bool(hf_get(cfg, "enable_bias", True))
    else:
        inter, act, eps = cfg.intermediate_size, cfg.hidden_act, hf_get(cfg, "layer_norm_eps", 1e-5)
        attention_bias, mlp_bias = bool(hf_get(cfg, "attention_bias", True)), True
    cfg.intermediate_size, cfg.hidden_act, cfg.rms_norm_eps = int(inter), act, float(eps)
    cfg.num_key_value_heads, cfg.head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    cfg.attention_bias, cfg.mlp_bias = attention_bias, mlp_bias
    return cfg


def family_fields(hf_config: Any, architecture: str, num_layers: int) -> dict:
    """The switches of GPT-2, OPT and GPT-NeoX (hf_config: `llama_config`'s)."""
    fields = dict(layer_norm=True, norm_bias=True, gated_mlp=False)
    if architecture == GPT_NEOX:
        parallel = bool(hf_get(hf_config, "use_parallel_residual", True))
        return dict(fields, parallel_block=parallel, parallel_mlp_norm=parallel)
    # no rope: the positions are a learned table's rows (OPT's from row 2)
    return dict(fields, learned_positions=True, position_offset=2 if architecture == OPT else 0,
                nope_layers=tuple(range(num_layers)))


def reader(cfg, get: Callable[[str], np.ndarray],
           has: Callable[[str], bool]) -> tuple[Callable[[str], np.ndarray], Callable[[str], bool]]:
    """(get, has) serving the Llama-style names (model.embed_tokens, model.embed_positions, model.norm,
    model.layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj, mlp.{up,down}_proj},
    lm_head) from a GPT-2, OPT or GPT-NeoX checkpoint, linear weights as PyTorch's [out, in]."""
    arch = cfg.architecture

    def locate(name: str) -> tuple[str, int | None] | None:
        """name -> (the checkpoint's tensor, which of q/k/v it holds if fused, else None), None if absent."""
        if name == "lm_head.weight":
            found = [head for head in _HEADS if has(head)]
            return (found[0], None) if found else None
        part, top, layer = None, _TOP.match(name), _LAYER.match(name)
        if top is not None:
            module, kind = top.groups()
            rel = _MODULES[module].get(arch)
        elif layer is not None:
            i, module, kind = layer.groups()
            if module in _QKV and arch in _FUSED_QKV:
                rel, part = _FUSED_QKV[arch], _QKV.index(module)
            else:
                rel = module if module in _QKV else _MODULES.get(module, {}).get(arch)
            rel = rel and f"{_LAYERS[arch]}.{i}.{rel}"
        else:
            rel = None
        if rel is None:
            return None
        found = [prefix + f"{rel}.{kind}" for prefix in _PREFIXES[arch] if has(prefix + f"{rel}.{kind}")]
        return (found[0], part) if found else None

    def get_gpt(name: str) -> np.ndarray:
        found = locate(name)
        if found is None:
            return get(name)
        real, part = found
        tensor = get(real)
        if isinstance(tensor, HostQuantized):
            tensor = tensor.as_float()
        conv1d = arch == GPT2 and tensor.ndim == 2 and ".h." in f".{real}"   # GPT-2's layers: Conv1D, [in, out]
        if conv1d:
            tensor = tensor.T
        if part is None:
            return tensor
        if arch == GPT2:   # c_attn's rows: q | k | v
            return tensor[part * cfg.q_size:(part + 1) * cfg.q_size]
        # NeoX's query_key_value rows: head by head, its q, k and v
        heads = tensor.reshape(cfg.num_heads, 3, cfg.head_dim, *tensor.shape[1:])
        return heads[:, part].reshape(cfg.q_size, *tensor.shape[1:])

    return get_gpt, (lambda name: locate(name) is not None or has(name))
