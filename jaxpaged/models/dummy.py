"""vLLM's `load_format="dummy"`: a model of a checkpoint's shapes with random weights, from its
config alone (no weight file is read): for speed and memory measurements of a model one does not
have, or would rather not write to disk. Its outputs mean nothing.

Weights are drawn uniform in [-DUMMY_RANGE, DUMMY_RANGE], every one (norm scales included), as
vLLM's `initialize_dummy_weights` draws them, straight on the devices in their shardings. Quantized
(`quantization="int8"` ...), the layers' matmul weights are drawn on the host and quantized there,
one layer at a time, as a checkpoint's would be.
"""

import itertools

import jax
import numpy as np

from jaxpaged.models.config import ModelConfig, model_config_from_hf
from jaxpaged.models.hf_names import QUANTIZABLE
from jaxpaged.models.hub_options import HubOptions
from jaxpaged.models.llama import layer_weight_shapes, weight_shapes
from jaxpaged.models.loader import (_DTYPES, LoadedModel, _local_folder, put_weight, resolve_dtype,
                                    resolve_scan_layers, sharded_config)
from jaxpaged.models.quantization import quantize, resolve_quantization
from jaxpaged.models.registry import model_class_for
from jaxpaged.parallel import ShardPlan

DUMMY_RANGE = 1e-3


def dummy_weights(cfg: ModelConfig, dtype: str, scan_layers: bool, plan: ShardPlan = ShardPlan(),
                  quantization: str | None = None, seed: int = 0) -> dict:
    """Random weights in the engine's layout, as `loader.convert_hf_weights` returns a checkpoint's:
    `cfg` is the checkpoint's config (the layers' shapes are those of `sharded_config(cfg, plan.size)`),
    stacked [num_layers, ...] when `scan_layers`, else a list of per-layer dicts."""
    np_dtype = _DTYPES[dtype]
    key, count = jax.random.key(seed), itertools.count()
    rng = np.random.default_rng(seed)

    def device_draw(name: str, shape: tuple[int, ...], stacked: bool = False) -> jax.Array:
        """Drawn where it lives, in its dtype (no float32 temporary of an 8B model's largest stack); the key
        is an argument, not a constant XLA could fold."""
        def draw(key):
            return jax.random.uniform(key, shape, np_dtype, -DUMMY_RANGE, DUMMY_RANGE)
        return plan.make(draw, plan.weight_spec(name, stacked), jax.random.fold_in(key, next(count)))

    def host_quantized(name: str, shape: tuple[int, ...]):
        value = rng.uniform(-DUMMY_RANGE, DUMMY_RANGE, shape).astype(np.float32)
        return quantize(value, quantization, plan.size).packed()

    weights = {name: device_draw(name, shape) for name, shape in weight_shapes(cfg).items()}
    layer_shapes = [layer_weight_shapes(sharded_config(cfg, plan.size), i) for i in range(cfg.num_layers)]
    quantized = set(QUANTIZABLE) if quantization is not None else set()
    if scan_layers:
        stacks = {}
        for name, shape in layer_shapes[0].items():
            if name in quantized:   # one layer at a time through the host, stacked there
                layers = [host_quantized(name, shape) for _ in range(cfg.num_layers)]
                stacks[name] = put_weight(plan, name, jax.tree.map(lambda *a: np.stack(a), *layers), stacked=True)
            else:
                stacks[name] = device_draw(name, (cfg.num_layers, *shape), stacked=True)
        weights["layers"] = stacks
    else:
        weights["layers"] = [{name: put_weight(plan, name, host_quantized(name, shape)) if name in quantized
                              else device_draw(name, shape) for name, shape in shapes.items()}
                             for shapes in layer_shapes]
    return weights


def load_dummy(model: str, dtype: str, revision: str | None, attention_backend: str, scan_layers: bool | None,
               shard_plan: ShardPlan, quantization: str | None, hub: HubOptions = HubOptions()):
    """loader.load_model for load_format="dummy": the config of `model` (a folder holding config.json, or
    a hub id), random weights. dtype "auto" is the config's (`torch_dtype`; float32 when it names none)."""
    if model.endswith(".gguf"):
        raise ValueError("load_format='dummy' takes a model folder with config.json or a hub id, not a .gguf file")
    folder = _local_folder(model, revision, weights=False, cache_dir=hub.download_dir)
    hf_config = hub.config(folder)
    cfg = model_config_from_hf(hf_config)
    configured = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)   # older transformers
    configured = str(configured or "float32").removeprefix("torch.")
    dtype = resolve_dtype(dtype, configured if configured in ("float32", "bfloat16", "float16") else "float32")
    quantization = resolve_quantization(quantization, None)
    weights = dummy_weights(cfg, dtype, resolve_scan_layers(scan_layers, cfg), shard_plan, quantization)
    cfg = sharded_config(cfg, shard_plan.size)
    return LoadedModel(model_class_for(cfg.architecture)(cfg, weights, attention_backend, shard_plan), cfg, hf_config,
                       dtype, folder, quantization)
