"""Which Flax model runs which Hugging Face architecture (`config.architectures[0]`)."""

from jaxpaged.models.config import SUPPORTED_ARCHITECTURES
from jaxpaged.models.llama import LlamaFamilyForCausalLM

MODEL_REGISTRY = {name: LlamaFamilyForCausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class_for(architecture: str):
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; supported architectures: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[architecture]
