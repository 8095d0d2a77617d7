"""PEFT adapter folders read into the engine's LoRA layout, on the host.

A PEFT LoRA layer adds `(x @ A.T) @ B.T * scaling` to a linear's output, with A [r, in], B [out, r]
and scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Here each target module `m`
becomes a[m] [num_layers, in, max_rank] and b[m] [num_layers, max_rank, out] with the scaling
folded into b, zero-padded to the engine's max_lora_rank (the padding adds exact zeros).
Modules an adapter leaves alone are absent (the engine keeps zeros there).

An adapter names the checkpoint's own linears (`adapter_linears`): Llama's q_proj ... down_proj, or a family's
(GPT-2's c_attn, NeoX's query_key_value, Phi's fc1 ...). A fused linear's B is split by its output rows into the
modules they feed (Phi-3's qkv_proj -> q, k, v; gate_up_proj -> gate, up: x @ A is the same for each part), and
an interleaved rope's q/k rows are reordered as the checkpoint's are (`hf_names.rotate_half_rows`).
"""

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxpaged.models import gpt_families
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.families import FUSED_LINEARS

MODULES = ("q", "k", "v", "o", "gate", "up", "down")
# a Llama layer's linears -> the modules their output rows hold
_LLAMA_LINEARS = {"self_attn.q_proj": ("q",), "self_attn.k_proj": ("k",), "self_attn.v_proj": ("v",),
                  "self_attn.o_proj": ("o",), "mlp.gate_proj": ("gate",), "mlp.up_proj": ("up",),
                  "mlp.down_proj": ("down",)}
_KEY = r"(?:^|\.)(?:layers|h)\.(\d+)\.({linears})\.lora_([AB])\.weight$"
# adapter_config.json keys whose non-default values change the math beyond plain LoRA (fan_in_fan_out does not:
# it is how GPT-2's Conv1D weights lie, and the adapter's A and B are nn.Linear's whatever it says)
_UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None,
                "layer_replication": None, "target_parameters": None, "lora_bias": False, "use_qalora": False,
                "trainable_token_indices": None, "alora_invocation_tokens": None}


def module_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of the logical (unsharded, un-repeated) linear (no gate in an ungated MLP)."""
    d, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    sizes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, inter), "up": (d, inter),
             "down": (inter, d)}
    if not cfg.gated_mlp:
        del sizes["gate"]
    return sizes


def adapter_linears(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The linears an adapter may target, by their name inside one of the checkpoint's layers -> the modules
    their output rows hold, in order (several for a fused linear)."""
    linears = dict(_LLAMA_LINEARS)
    if not cfg.gated_mlp:
        del linears["mlp.gate_proj"]
    for fused, parts in FUSED_LINEARS.get(cfg.architecture, {}).items():   # Phi-3's qkv_proj, gate_up_proj ...
        linears[fused] = tuple(module for part in parts for module in linears.pop(part))
    return gpt_families.lora_linears(cfg.architecture, linears)


@dataclasses.dataclass
class HostAdapter:
    """One adapter in the engine's layout (host numpy arrays, the model dtype)."""

    a: dict[str, np.ndarray]   # module -> [num_layers, in, max_rank]
    b: dict[str, np.ndarray]   # module -> [num_layers, max_rank, out], scaling folded in
    rank: int                  # the largest rank of its modules

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"lora_path {path!r} is not a PEFT adapter folder (no adapter_config.json)")
    with open(config_path) as f:
        config = json.load(f)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"adapter {path!r}: peft_type must be 'LORA', got {config.get('peft_type')!r}")
    for key, default in _UNSUPPORTED.items():
        if config.get(key, default) not in (default, [], {}):
            raise ValueError(f"adapter {path!r}: {key}={config[key]!r} is not supported (allowed: {default!r})")
    return config


def _tensors(path: str) -> dict[str, np.ndarray]:
    from jaxpaged.models.safetensors_io import SafetensorsFile
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"adapter {path!r}: no adapter_model.safetensors (only safetensors adapters are read)")
    st = SafetensorsFile(file)
    return {name: st.get(name) for name in st.names()}


def _pattern_value(pattern: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key matching the module's name (its name in
    the model: model.layers.3.self_attn.q_proj)."""
    for key, value in (pattern or {}).items():
        if re.search(rf"(^|\.){key}$", name) or re.fullmatch(key, name):
            return value
    return default


def load_peft_adapter(path: str, cfg: ModelConfig, max_rank: int, dtype) -> HostAdapter:
    """Read a PEFT LoRA folder for a model of config `cfg`. Raises ValueError naming what is wrong:
    no folder, an unsupported option, a module other than the linears the model's family has
    (`adapter_linears`), a rank above `max_rank`, or a tensor of the wrong shape."""
    from jaxpaged.models.hf_names import rotate_half_rows

    config = _read_config(path)
    tensors = _tensors(path)
    sizes = module_sizes(cfg)
    linears = adapter_linears(cfg)
    key = re.compile(_KEY.format(linears="|".join(re.escape(name) for name in linears)))
    found: dict[tuple[str, int, str], dict[str, np.ndarray]] = {}   # (linear, layer, its name in the model) ->
    for name, value in tensors.items():
        match = key.search(name)
        if match is None:
            raise ValueError(f"adapter {path!r}: tensor {name!r} is not a LoRA A/B weight of "
                             f"{', '.join(linears)}")
        layer, linear = int(match.group(1)), match.group(2)
        if layer >= cfg.num_layers:
            raise ValueError(f"adapter {path!r}: tensor {name!r} is for layer {layer}, the model has {cfg.num_layers}")
        module_name = name[:match.start(3) - len(".lora_")].removeprefix("base_model.model.")
        found.setdefault((linear, layer, module_name), {})[match.group(3)] = value
    if not found:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    rank = 0
    for (linear, layer, module_name), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {path!r}: layer {layer} {linear} has lora_{''.join(pair)} only")
        modules = linears[linear]
        n_in, n_out = sizes[modules[0]][0], sum(sizes[m][1] for m in modules)
        r = pair["A"].shape[0]
        if pair["A"].shape != (r, n_in) or pair["B"].shape != (n_out, r):
            raise ValueError(f"adapter {path!r}: layer {layer} {linear} has lora_A {pair['A'].shape} and "
                             f"lora_B {pair['B'].shape}, expected ({r}, {n_in}) and ({n_out}, {r})")
        if r > max_rank:
            raise ValueError(f"adapter {path!r} has rank {r} (layer {layer} {linear}), above "
                             f"max_lora_rank={max_rank}: start the engine with max_lora_rank >= {r}")
        rank = max(rank, r)
        alpha = _pattern_value(config.get("alpha_pattern"), module_name, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        for j, module in enumerate(modules):   # a fused linear's B: each module's rows
            rows = gpt_families.fused_rows(cfg, pair["B"], j, [sizes[m][1] for m in modules])
            if cfg.rope_interleaved and module in ("q", "k"):   # as the checkpoint's q/k rows are
                rows = rotate_half_rows(cfg, rows)
            if module not in a:
                a[module] = np.zeros((cfg.num_layers, n_in, max_rank), dtype)
                b[module] = np.zeros((cfg.num_layers, max_rank, sizes[module][1]), dtype)
            a[module][layer, :, :r] = pair["A"].astype(np.float32).T
            b[module][layer, :r, :] = rows.astype(np.float32).T * np.float32(scaling)
    return HostAdapter(a, b, rank)
