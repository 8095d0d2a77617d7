"""The scheduler's settings (vLLM's SchedulerConfig), checked when made."""

import dataclasses

from jaxpaged.core.preemption import PREEMPTION_MODES
from jaxpaged.core.request_queue import SCHEDULING_POLICIES


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    max_loras: int = 0                 # multi-LoRA: most adapters running at once (0: no LoRA)
    policy: str = "fcfs"               # "fcfs" | "priority" (vLLM's scheduling_policy)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len}) when chunked prefill is off, or no long prompt could run")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.policy!r}")
