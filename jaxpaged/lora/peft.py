"""PEFT adapter folders read into the engine's LoRA layout, on the host.

A PEFT LoRA layer adds `(x @ A.T) @ B.T * scaling` to a linear's output, with A [r, in], B [out, r]
and scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Here each target module `m`
becomes a[m] [num_layers, in, max_rank] and b[m] [num_layers, max_rank, out] with the scaling
folded into b, zero-padded to the engine's max_lora_rank (the padding adds exact zeros).
Modules an adapter leaves alone are absent (the engine keeps zeros there).
"""

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxpaged.models.config import ModelConfig

# module -> (the HF linear's name inside a layer, its in and out sizes)
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
_HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.lora_([AB])\.weight$")
# adapter_config.json keys whose non-default values change the math beyond plain LoRA
_UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None, "fan_in_fan_out": False,
                "layer_replication": None, "target_parameters": None, "lora_bias": False, "use_qalora": False,
                "trainable_token_indices": None, "alora_invocation_tokens": None}


def module_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of the logical (unsharded, un-repeated) linear."""
    d, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, inter), "up": (d, inter),
            "down": (inter, d)}


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


def _pattern_value(pattern: dict, hf_module: str, layer: int, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key matching the module's name."""
    name = f"model.layers.{layer}.{hf_module}"
    for key, value in (pattern or {}).items():
        if re.search(rf"(^|\.){key}$", name) or re.fullmatch(key, name):
            return value
    return default


def load_peft_adapter(path: str, cfg: ModelConfig, max_rank: int, dtype) -> HostAdapter:
    """Read a PEFT LoRA folder for a model of config `cfg`. Raises ValueError naming what is wrong:
    no folder, an unsupported option, a module other than q/k/v/o/gate/up/down, a rank above
    `max_rank`, or a tensor of the wrong shape."""
    config = _read_config(path)
    tensors = _tensors(path)
    sizes = module_sizes(cfg)
    by_hf = {hf: m for m, hf in _HF_NAMES.items()}
    found: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        match = _KEY.search(name)
        if match is None:
            raise ValueError(f"adapter {path!r}: tensor {name!r} is not a LoRA A/B weight of "
                             f"{', '.join(hf for hf in _HF_NAMES.values())}")
        layer, module = int(match.group(1)), by_hf[match.group(2)]
        if layer >= cfg.num_layers:
            raise ValueError(f"adapter {path!r}: tensor {name!r} is for layer {layer}, the model has {cfg.num_layers}")
        found.setdefault((module, layer), {})[match.group(3)] = value
    if not found:
        raise ValueError(f"adapter {path!r} holds no LoRA weights")
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    rank = 0
    for (module, layer), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {path!r}: layer {layer} {_HF_NAMES[module]} has lora_{''.join(pair)} only")
        n_in, n_out = sizes[module]
        r = pair["A"].shape[0]
        if pair["A"].shape != (r, n_in) or pair["B"].shape != (n_out, r):
            raise ValueError(f"adapter {path!r}: layer {layer} {_HF_NAMES[module]} has lora_A {pair['A'].shape} and "
                             f"lora_B {pair['B'].shape}, expected ({r}, {n_in}) and ({n_out}, {r})")
        if r > max_rank:
            raise ValueError(f"adapter {path!r} has rank {r} (layer {layer} {_HF_NAMES[module]}), above "
                             f"max_lora_rank={max_rank}: start the engine with max_lora_rank >= {r}")
        rank = max(rank, r)
        alpha = _pattern_value(config.get("alpha_pattern"), _HF_NAMES[module], layer, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        if module not in a:
            a[module] = np.zeros((cfg.num_layers, n_in, max_rank), dtype)
            b[module] = np.zeros((cfg.num_layers, max_rank, n_out), dtype)
        a[module][layer, :, :r] = pair["A"].astype(np.float32).T
        b[module][layer, :r, :] = pair["B"].astype(np.float32).T * np.float32(scaling)
    return HostAdapter(a, b, rank)
