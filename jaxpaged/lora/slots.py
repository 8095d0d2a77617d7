"""The model's LoRA slots: the stacked A and B weights every adapter slot holds (zeros where a slot or a module
is empty, `jaxpaged.lora.peft`'s layout) and each token's delta (x @ A[slot]) @ B[slot] (the model adds it to
each projection's output; a base-model token adds exact zeros)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.lora.peft import module_sizes
from jaxpaged.models.config import ModelConfig


def lora_shapes(cfg: ModelConfig, max_loras: int, max_rank: int) -> dict[str, tuple[int, ...]]:
    """name -> shape of the LoRA stacks: "{module}_a" [layers, slots, in, rank], "{module}_b" [layers, slots, rank,
    out]."""
    out = {}
    for module, (n_in, n_out) in module_sizes(cfg).items():
        out[f"{module}_a"] = (cfg.num_layers, max_loras, n_in, max_rank)
        out[f"{module}_b"] = (cfg.num_layers, max_loras, max_rank, n_out)
    return out


def lora_delta(x: jax.Array, lora: dict, module: str, onehot: jax.Array) -> jax.Array:
    """Each token's (x @ A) @ B for its own slot's adapter (one layer's stacks in `lora`)."""
    xa = jnp.einsum("ti,sir->tsr", x, lora[f"{module}_a"]) * onehot[:, :, None]
    return jnp.einsum("tsr,sro->to", xa, lora[f"{module}_b"]).astype(x.dtype)


def attach_lora(model, max_loras: int, max_rank: int) -> None:
    """Give the model (a LlamaFamilyForCausalLM) `max_loras` empty adapter slots (zeros, replicated on its
    devices)."""
    plan = model.shard_plan
    model.lora = nnx.data(nnx.Dict({name: nnx.Param(plan.zeros(shape, model.dtype))
                                    for name, shape in lora_shapes(model.config, max_loras, max_rank).items()}))
