"""Multi-LoRA: PEFT adapters served beside the base model, several in one step (see lora.manager)."""

from jaxpaged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
