"""preemption_mode="auto": a preempted request's blocks are swapped to host memory when moving them
costs less time than computing its tokens again, and dropped (recomputed later) otherwise.

    swap:       2 x blocks x bytes per block / host copy rate    (out now, back in later)
    recompute:  tokens computed so far / prefill rate

The copy rate is measured at start-up (a round trip of the largest block move, runner
`measure_copy_rate`); the prefill rate from the engine's own steps that compute prompt chunks
(tokens a step computed / its time, a moving average). Until both are known, recompute (vLLM's only
mode). `recompute` and `swap` keep their meaning: always the one (swap when the host space has room).
"""

import dataclasses

PREEMPTION_MODES = ("recompute", "swap", "auto")
_MIN_PREFILL_TOKENS = 16     # a step computing fewer prompt tokens says little about the prefill rate
_SMOOTHING = 0.2


@dataclasses.dataclass
class PreemptionCost:
    block_bytes: int                              # KV bytes of one block, every layer
    copy_bytes_per_s: float | None = None         # device <-> host memory, one way
    prefill_tokens_per_s: float | None = None

    def observe_step(self, prompt_tokens: int, seconds: float) -> None:
        """A completed step that computed `prompt_tokens` of prompts (and maybe decodes) in `seconds`."""
        if prompt_tokens < _MIN_PREFILL_TOKENS or seconds <= 0:
            return
        rate = prompt_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * rate

    def swap_seconds(self, num_blocks: int) -> float | None:
        return None if not self.copy_bytes_per_s else 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float | None:
        return None if not self.prefill_tokens_per_s else num_tokens / self.prefill_tokens_per_s

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        swap, recompute = self.swap_seconds(num_blocks), self.recompute_seconds(num_tokens)
        return swap is not None and recompute is not None and swap < recompute
