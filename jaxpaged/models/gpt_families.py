"""GPT-2, GPT-BigCode (StarCoder, SantaCoder), OPT, GPT-J, GPT-NeoX (Pythia), Falcon, Phi (phi-1, 1.5, 2) and
StarCoder2: the LayerNorm decoders with an ungated MLP, run as switches of the same layer.

What sets them apart from Llama's layer is a handful of `ModelConfig` switches:

- all: LayerNorms with a bias (`layer_norm`, `norm_bias`), an MLP without a gate (`gated_mlp=False`: up, the
  activation, down), biases on the projections (not GPT-J's attention, nor StarCoder2's where use_bias=False).
- GPT-2, GPT-BigCode and OPT: learned absolute positions added to the token embedding (`learned_positions`;
  OPT's table starts at row 2, `position_offset`), no rope; GPT-BigCode's one KV head (multi_query).
- GPT-NeoX: a partial rotate-half rope, and (use_parallel_residual) attention and the MLP side by side
  (`parallel_block`), each on its own norm of the layer's input (`parallel_mlp_norm`).
- Phi and GPT-J: attention and the MLP side by side on one normed input, a partial rope (GPT-J's interleaved),
  an LM head with a bias (`lm_head_bias`).
- Falcon: NeoX's blocks (one norm or two: Falcon-40B's ln_attn and ln_mlp; or one after the other), one KV head
  (multi_query) or grouped ones (new_decoder_architecture).
- StarCoder2: Llama's layer otherwise (grouped-query attention, a sliding window).

Their configs and checkpoints have names of their own: `llama_config` gives a config the field names the
config reader reads (a copy), and `reader` serves the Llama-style tensor names the loader asks for from their
checkpoints (GPT-2's Conv1D weights, [in, out], transposed; the fused c_attn and query_key_value split into q, k
and v: `fused_rows`).
"""

import copy
import re
from typing import Any, Callable

import numpy as np

from jaxpaged.models.families import hf_get
from jaxpaged.models.quantization import HostQuantized

GPT2 = "GPT2LMHeadModel"
GPT_BIGCODE = "GPTBigCodeForCausalLM"
OPT = "OPTForCausalLM"
GPT_NEOX = "GPTNeoXForCausalLM"
GPTJ = "GPTJForCausalLM"
FALCON = "FalconForCausalLM"
PHI = "PhiForCausalLM"
STARCODER2 = "Starcoder2ForCausalLM"
ARCHITECTURES = (GPT2, GPT_BIGCODE, OPT, GPT_NEOX, GPTJ, FALCON, PHI, STARCODER2)
_GPT2_LIKE = (GPT2, GPT_BIGCODE)   # GPT-2's names and config fields

# Llama-style module -> each family's name for it (a layer's, then the model's own); Llama's where not listed
_MODULES = {
    "input_layernorm": {GPT2: "ln_1", GPT_BIGCODE: "ln_1", OPT: "self_attn_layer_norm", GPTJ: "ln_1"},
    "post_attention_layernorm": {GPT2: "ln_2", GPT_BIGCODE: "ln_2", OPT: "final_layer_norm"},
    "self_attn.q_proj": {GPTJ: "attn.q_proj"},
    "self_attn.k_proj": {GPTJ: "attn.k_proj"},
    "self_attn.v_proj": {GPTJ: "attn.v_proj"},
    "self_attn.o_proj": {GPT2: "attn.c_proj", GPT_BIGCODE: "attn.c_proj", OPT: "self_attn.out_proj",
                         GPT_NEOX: "attention.dense", GPTJ: "attn.out_proj", PHI: "self_attn.dense",
                         FALCON: "self_attention.dense"},
    "mlp.up_proj": {GPT2: "mlp.c_fc", GPT_BIGCODE: "mlp.c_fc", OPT: "fc1", GPT_NEOX: "mlp.dense_h_to_4h",
                    GPTJ: "mlp.fc_in", PHI: "mlp.fc1", STARCODER2: "mlp.c_fc", FALCON: "mlp.dense_h_to_4h"},
    "mlp.down_proj": {GPT2: "mlp.c_proj", GPT_BIGCODE: "mlp.c_proj", OPT: "fc2", GPT_NEOX: "mlp.dense_4h_to_h",
                      GPTJ: "mlp.fc_out", PHI: "mlp.fc2", STARCODER2: "mlp.c_proj", FALCON: "mlp.dense_4h_to_h"},
    "embed_tokens": {GPT2: "wte", GPT_BIGCODE: "wte", GPT_NEOX: "embed_in", GPTJ: "wte", FALCON: "word_embeddings"},
    "embed_positions": {GPT2: "wpe", GPT_BIGCODE: "wpe"},
    "norm": {GPT2: "ln_f", GPT_BIGCODE: "ln_f", OPT: "final_layer_norm", GPT_NEOX: "final_layer_norm", GPTJ: "ln_f",
             PHI: "final_layernorm", FALCON: "ln_f"},
}
_FALCON_TWO_NORMS = {"input_layernorm": "ln_attn", "post_attention_layernorm": "ln_mlp"}   # Falcon-40B's
_FUSED_QKV = {GPT2: "attn.c_attn", GPT_BIGCODE: "attn.c_attn", GPT_NEOX: "attention.query_key_value",
              FALCON: "self_attention.query_key_value"}
# fused q/k/v rows laid out per KV head: its queries, its key, its value (one KV head: q | k | v)
_GROUPED_QKV = (GPT_NEOX, GPT_BIGCODE, FALCON)
# where the model's tensors lie: under its causal LM's prefix, or (a base model's save) without it
_PREFIXES = {GPT2: ("transformer.", ""), GPT_BIGCODE: ("transformer.",), OPT: ("model.decoder.", "decoder."),
             GPT_NEOX: ("gpt_neox.",), GPTJ: ("transformer.",), FALCON: ("transformer.",), PHI: ("model.",),
             STARCODER2: ("model.",)}
_LAYERS = {GPT2: "h", GPT_BIGCODE: "h", GPTJ: "h", FALCON: "h"}   # (the others': layers)
_HEADS = ("lm_head", "embed_out")   # NeoX's head as released: embed_out
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_TOP = re.compile(r"model\.(embed_tokens|embed_positions|norm)\.(weight|bias)$")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def llama_config(hf_config: Any, architecture: str) -> Any:
    """A copy of one of these families' configs with the fields the config reader reads (intermediate_size,
    hidden_act, rms_norm_eps: the LayerNorms' eps, num_key_value_heads, attention_bias, mlp_bias,
    partial_rotary_factor for GPT-J); ValueError for a variant we do not run."""
    cfg = copy.deepcopy(hf_config)
    heads = cfg.num_attention_heads
    kv_heads, eps, attention_bias, mlp_bias = heads, hf_get(cfg, "layer_norm_epsilon", 1e-5), True, True
    if architecture in _GPT2_LIKE:
        for name, unsupported in (("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True),
                                  ("add_cross_attention", True)):
            if bool(hf_get(cfg, name, not unsupported)) == unsupported:
                raise ValueError(f"{architecture} with {name}={unsupported} is not supported")
        if architecture == GPT_BIGCODE and hf_get(cfg, "multi_query", True):   # one KV head
            kv_heads = 1
    if architecture in (*_GPT2_LIKE, GPTJ):
        inter, act = hf_get(cfg, "n_inner", 4 * cfg.hidden_size), cfg.activation_function
        if architecture == GPTJ:   # q/k/v and out_proj without biases; rotary_dim of each head turns (all: None)
            attention_bias = False
            cfg.partial_rotary_factor = hf_get(cfg, "rotary_dim", cfg.hidden_size // heads) / (cfg.hidden_size // heads)
    elif architecture == FALCON:
        if hf_get(cfg, "alibi", False):
            raise ValueError(f"{architecture} with alibi=True (Falcon-RW's ALiBi positions) is not supported")
        inter, act, eps = hf_get(cfg, "ffn_hidden_size", 4 * cfg.hidden_size), cfg.activation, cfg.layer_norm_epsilon
        kv_heads, attention_bias = cfg.num_key_value_heads, bool(hf_get(cfg, "bias", False))
        mlp_bias = attention_bias
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
    else:   # GPT-NeoX, Phi, StarCoder2: Llama's names for the sizes
        inter, act = cfg.intermediate_size, cfg.hidden_act
        kv_heads = hf_get(cfg, "num_key_value_heads", heads)
        eps = hf_get(cfg, "norm_epsilon" if architecture == STARCODER2 else "layer_norm_eps", 1e-5)
        if architecture == GPT_NEOX:
            attention_bias = bool(hf_get(cfg, "attention_bias", True))
        if architecture == STARCODER2:
            attention_bias = mlp_bias = bool(hf_get(cfg, "use_bias", True))
        if architecture == PHI and hf_get(cfg, "qk_layernorm", False):
            raise ValueError(f"{architecture} with qk_layernorm=True is not supported (the released Phi checkpoints "
                             "have none)")
    cfg.intermediate_size, cfg.hidden_act, cfg.rms_norm_eps = int(inter), act, float(eps)
    cfg.num_key_value_heads = kv_heads
    if getattr(cfg, "head_dim", None) is None:   # (Falcon's is a property)
        cfg.head_dim = cfg.hidden_size // heads
    cfg.attention_bias, cfg.mlp_bias = attention_bias, mlp_bias
    return cfg


def family_fields(hf_config: Any, architecture: str, num_layers: int) -> dict:
    """The switches of these families (hf_config: `llama_config`'s)."""
    fields = dict(layer_norm=True, norm_bias=True, gated_mlp=False)
    if architecture == GPT_NEOX:
        parallel = bool(hf_get(hf_config, "use_parallel_residual", True))
        return dict(fields, parallel_block=parallel, parallel_mlp_norm=parallel)
    if architecture == FALCON:   # the new (40B) architecture: always side by side, two norms unless told one
        new = bool(hf_get(hf_config, "new_decoder_architecture", False))
        two_norms = new and int(hf_get(hf_config, "num_ln_in_parallel_attn", 2)) == 2
        return dict(fields, parallel_block=new or bool(hf_get(hf_config, "parallel_attn", True)),
                    parallel_mlp_norm=two_norms)
    if architecture in (PHI, GPTJ):   # one norm before attention and the MLP both; GPT-J turns pairs (2i, 2i + 1)
        return dict(fields, parallel_block=True, lm_head_bias=True, rope_interleaved=architecture == GPTJ)
    if architecture == STARCODER2:
        return fields
    # no rope: the positions are a learned table's rows (OPT's from row 2)
    return dict(fields, learned_positions=True, position_offset=2 if architecture == OPT else 0,
                nope_layers=tuple(range(num_layers)))


def lora_linears(architecture: str, linears: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """An adapter's linears (a Llama layer's names -> the modules they feed, `lora.peft.adapter_linears`) under
    this family's names (GPT-2's c_attn and NeoX's query_key_value feed q, k and v); others' as they are."""
    if architecture not in ARCHITECTURES:
        return linears
    out = {_MODULES.get(name, {}).get(architecture, name): modules for name, modules in linears.items()
           if not (architecture in _FUSED_QKV and name in _QKV)}
    if architecture in _FUSED_QKV:
        out[_FUSED_QKV[architecture]] = ("q", "k", "v")
    return out


def fused_rows(cfg, tensor: np.ndarray, part: int, sizes: list[int]) -> np.ndarray:
    """The rows of a fused linear's output (its weight, bias, or an adapter's B) that feed part `part` of its
    parts of `sizes` rows: consecutive blocks, or (NeoX's, GPT-BigCode's and Falcon's q/k/v) KV head by KV head,
    its queries, its key and its value."""
    if cfg.architecture in _GROUPED_QKV and len(sizes) == 3:
        group = cfg.num_heads // cfg.num_kv_heads
        heads = tensor.reshape(cfg.num_kv_heads, group + 2, cfg.head_dim, *tensor.shape[1:])
        rows = heads[:, :group] if part == 0 else heads[:, group + part - 1]
        return rows.reshape(sizes[part], *tensor.shape[1:])
    start = sum(sizes[:part])
    return tensor[start:start + sizes[part]]


def _module_name(cfg, module: str) -> str:
    """A Llama-style module's name in the checkpoint's family."""
    if cfg.architecture == FALCON and cfg.parallel_mlp_norm and module in _FALCON_TWO_NORMS:
        return _FALCON_TWO_NORMS[module]
    return _MODULES.get(module, {}).get(cfg.architecture, module)


def reader(cfg, get: Callable[[str], np.ndarray],
           has: Callable[[str], bool]) -> tuple[Callable[[str], np.ndarray], Callable[[str], bool]]:
    """(get, has) serving the Llama-style names (model.embed_tokens, model.embed_positions, model.norm,
    model.layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj, mlp.{up,down}_proj},
    lm_head) from these families' checkpoints, linear weights as PyTorch's [out, in]."""
    arch = cfg.architecture

    def locate(name: str) -> tuple[str, int | None] | None:
        """name -> (the checkpoint's tensor, which of q/k/v it holds if fused, else None), None if absent."""
        if name.startswith("lm_head."):
            found = [f"{head}.{name.partition('.')[2]}" for head in _HEADS if has(f"{head}.{name.partition('.')[2]}")]
            return (found[0], None) if found else None
        part, top, layer = None, _TOP.match(name), _LAYER.match(name)
        if top is not None:
            module, kind = top.groups()
            rel = _module_name(cfg, module)
        elif layer is not None:
            i, module, kind = layer.groups()
            if module in _QKV and arch in _FUSED_QKV:
                rel, part = _FUSED_QKV[arch], _QKV.index(module)
            else:
                rel = _module_name(cfg, module)
            rel = f"{_LAYERS.get(arch, 'layers')}.{i}.{rel}"
        else:
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
        if arch == GPT2 and tensor.ndim == 2 and ".h." in f".{real}":   # GPT-2's layers: Conv1D, [in, out]
            tensor = tensor.T
        return tensor if part is None else fused_rows(cfg, tensor, part, [cfg.q_size, cfg.kv_size, cfg.kv_size])

    return get_gpt, (lambda name: locate(name) is not None or has(name))
