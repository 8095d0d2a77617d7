"""vLLM's arguments for what transformers reads beside the weights: `trust_remote_code` (a checkpoint's own
config or tokenizer code may run), `hf_overrides` (fields of the checkpoint's config changed before the
model is built from it: `{"max_position_embeddings": 8192}`, a nested dict for a sub-config such as
`text_config`, or a function of the config returning it) and `download_dir` (where a hub id's files go)."""

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class HubOptions:
    trust_remote_code: bool = False
    hf_overrides: Any = None   # dict | Callable[[PretrainedConfig], PretrainedConfig] | None
    download_dir: str | None = None   # a hub id's snapshot goes here (None: the hub's cache, HF_HUB_CACHE)

    @classmethod
    def of(cls, args) -> "HubOptions":
        """An EngineArgs' options."""
        return cls(args.trust_remote_code, args.hf_overrides, args.download_dir)

    def config(self, folder: str):
        """The folder's (or hub id's) transformers config, with the overrides applied."""
        from transformers import AutoConfig

        return self.override(AutoConfig.from_pretrained(folder, trust_remote_code=self.trust_remote_code))

    def override(self, hf_config):
        """hf_config changed by hf_overrides (ValueError naming it for a value of neither allowed kind)."""
        if self.hf_overrides is None:
            return hf_config
        if callable(self.hf_overrides):
            changed = self.hf_overrides(hf_config)
            if changed is None or not hasattr(changed, "to_dict"):
                raise ValueError(f"hf_overrides, a function, must return the config it was given (got "
                                 f"{type(changed).__name__})")
            return changed
        if not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict or a function of the config, got "
                             f"{type(self.hf_overrides).__name__}")
        _apply(hf_config, self.hf_overrides)
        return hf_config


def _apply(config, overrides: dict) -> None:
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):   # a sub-config: its own fields
            _apply(current, value)
        else:
            setattr(config, key, value)
