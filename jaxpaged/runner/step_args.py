"""The step's device inputs that stay on the device unless a step needs them sent (ModelRunner inherits
this): the structured-output bitmask (all ones where no row is constrained), the prompt-embeddings rows
(zeros where no token reads one) and the M-RoPE offsets (zeros where no token has them). Each kept one is made
once per bucket, at start-up (warmup)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.runner.batch_builder import BatchShape


class StepArgs:
    def _embeds_arg(self, shape: BatchShape, embeds: list | None):
        """The step's prompt-embeddings input (enable_prompt_embeds; else None): [T, hidden] in the model
        dtype, sent when some token takes its row from a prompt's embeddings, else zeros kept on the device."""
        if not self.takes_prompt_embeds:
            return None
        return self._token_rows(shape, embeds, (self.model_config.hidden_size,), self.embeds_dtype, self._no_embeds)

    def _mrope_arg(self, shape: BatchShape, mrope: list | None):
        """The step's M-RoPE offsets (takes_mrope; else None): i32[T, 3], sent when some token has them (a
        prompt token of a request with images, InputBatch.mrope), else zeros kept on the device."""
        if not self.takes_mrope:
            return None
        return self._token_rows(shape, mrope, (3,), np.int32, self._no_mrope)

    def _token_rows(self, shape: BatchShape, runs: list | None, width: tuple, dtype, zeros_by_tokens: dict):
        """[T, *width] of `dtype`: each (flat token index, rows) of `runs` in place, zeros elsewhere; sent when
        there are runs, else zeros kept on the device (made at start-up by warmup: a copy, nothing compiled)."""
        if runs:
            rows = np.zeros((shape.num_tokens, *width), dtype)
            for flat, values in runs:
                rows[flat:flat + len(values)] = values
            return self.plan.put(rows)
        zeros = zeros_by_tokens.get(shape.num_tokens)
        if zeros is None:
            zeros = zeros_by_tokens[shape.num_tokens] = self.plan.put(np.zeros((shape.num_tokens, *width), dtype))
        return zeros

    def _bitmask_arg(self, shape: BatchShape, bitmask: np.ndarray | None):
        """The step's bitmask input: sent when some row is constrained, else kept on the device."""
        if bitmask is not None:
            return self.plan.put(bitmask)
        allowed = self._all_allowed.get(shape.num_logits)
        if allowed is None:
            with jax.default_device(self.plan.local_device):
                allowed = self.plan.replicate(jnp.full((shape.num_logits, self.bitmask_words), -1, jnp.int32))
            self._all_allowed[shape.num_logits] = allowed
        return allowed
