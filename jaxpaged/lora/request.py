"""LoRARequest: which adapter a request runs with (vLLM's names)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`), named for the
    user (`lora_name`, the model name a server request selects it by) and numbered for the engine
    (`lora_int_id` >= 1, unique per adapter: requests with the same id share its loaded weights and
    its prefix cache)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the adapter's folder, got {self.lora_path!r}")


def lora_cache_salt(cache_salt: str | None, lora_request: "LoRARequest | None") -> str | None:
    """The prefix-cache salt of a request's blocks: its own salt, and its adapter (id and folder) if
    any: K/V computed with one adapter is never found by the base model or another adapter."""
    if lora_request is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora {lora_request.lora_int_id} {lora_request.lora_path}"
