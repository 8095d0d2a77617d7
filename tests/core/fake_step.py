"""What the scheduler reads of a sampling request's parameters and of a runner's step result, for
tests that drive it without a model."""

import types


def fake_params(max_tokens: int, **fields) -> types.SimpleNamespace:
    """The SamplingParams fields the scheduler reads: no EOS or stop tokens to stop on, no min_tokens."""
    return types.SimpleNamespace(**{"max_tokens": max_tokens, "min_tokens": 0, "ignore_eos": False,
                                    "stop_token_ids": None, "prompt_logprobs": None, **fields})


class FakeStepResult:
    """A StepResult's columns for `plan`: each sampling request (forks too) with its token from
    `sampled` (request id -> token; others sampled nothing), and `kept` (speculative decoding:
    request id -> the tokens kept after the first)."""

    def __init__(self, plan, sampled: dict[str, int], kept: dict[str, list[int]] | None = None):
        self.requests = [r for c in plan.chunks if c.samples for r in (c.request, *c.forks)
                         if r.request_id in sampled]
        self.token_ids = [sampled[r.request_id] for r in self.requests]
        self.kept = kept or {}
