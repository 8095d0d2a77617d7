"""Host-built SamplingMetadata for sampler tests: per-request parameters -> padded numpy arrays.

The engine keeps these arrays on the device (runner/persistent_batch.py) and never builds them
this way; tests build them here to call `sampler.sample` on batches they choose, and as the
reference the persistent batch's slots are checked against.
"""

import numpy as np

from jaxpaged.runner.sampler import SamplingMetadata, uses_output_tokens
from jaxpaged.sampling_params import GREEDY_EPS


def _check(name, value, ok, allowed):
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range; allowed: {allowed}")


def _validate_params(p, vocab_size):
    _check("temperature", p.temperature, p.temperature >= 0, ">= 0")
    _check("top_k", p.top_k, p.top_k >= -1, "0 or -1 (off) or a positive int")
    _check("top_p", p.top_p, 0 < p.top_p <= 1, "(0, 1]")
    _check("min_p", p.min_p, 0 <= p.min_p <= 1, "[0, 1]")
    _check("presence_penalty", p.presence_penalty, -2 <= p.presence_penalty <= 2, "[-2, 2]")
    _check("frequency_penalty", p.frequency_penalty, -2 <= p.frequency_penalty <= 2, "[-2, 2]")
    _check("repetition_penalty", p.repetition_penalty, p.repetition_penalty > 0, "> 0")
    n = p.logprobs
    _check("logprobs", n, n is None or n == -1 or 0 <= n <= vocab_size,
           f"None, -1 (whole vocabulary) or [0, {vocab_size}]")
    for token in (p.logit_bias or {}):
        _check("logit_bias token id", token, 0 <= int(token) < vocab_size, f"[0, {vocab_size})")


def _token_ids(name, row, ids, vocab_size):
    ids = np.asarray(ids, np.int64).reshape(-1)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    _check(f"{name}[{row}] token id", bad[:1].tolist(), bad.size == 0, f"[0, {vocab_size})")
    return ids


def build_sampling_metadata(params: list, seeds: list[int], steps: list[int],
                            output_token_ids: list[list[int]], prompt_token_ids: list[list[int]],
                            extra_bias: list[dict[int, float] | None], vocab_size: int,
                            padded_size: int) -> SamplingMetadata:
    """Host side: per-request parameters -> padded numpy SamplingMetadata (rows past
    len(params) are greedy padding). The [S, V] arrays stay None when no row needs them."""
    n = len(params)
    for name, value in (("seeds", seeds), ("steps", steps), ("output_token_ids", output_token_ids),
                        ("prompt_token_ids", prompt_token_ids), ("extra_bias", extra_bias)):
        _check(f"len({name})", len(value), len(value) == n, f"len(params) = {n}")
    _check("vocab_size", vocab_size, vocab_size >= 1, ">= 1")
    _check("padded_size", padded_size, padded_size >= max(n, 1), f">= max(len(params), 1) = {max(n, 1)}")
    for p in params:
        _validate_params(p, vocab_size)

    def column(values, default, dtype):
        out = np.full((padded_size,), default, dtype)
        out[:n] = values
        return out

    temperature = column([p.temperature for p in params], 0.0, np.float32)
    top_k = column([max(p.top_k, 0) for p in params], 0, np.int32)
    presence = column([p.presence_penalty for p in params], 0.0, np.float32)
    frequency = column([p.frequency_penalty for p in params], 0.0, np.float32)
    repetition = column([p.repetition_penalty for p in params], 1.0, np.float32)
    # Python ints of any size are accepted as seeds; the key only takes 32 bits.
    seeds_u32 = column([int(s) & 0xFFFFFFFF for s in seeds], 0, np.uint32)

    output_counts = prompt_mask = None
    if any(map(uses_output_tokens, params)):
        output_counts = np.zeros((padded_size, vocab_size), np.int32)
        prompt_mask = np.zeros((padded_size, vocab_size), bool)
        for i in range(n):
            output_counts[i] = np.bincount(_token_ids("output_token_ids", i, output_token_ids[i],
                                                      vocab_size), minlength=vocab_size)
            prompt_mask[i, _token_ids("prompt_token_ids", i, prompt_token_ids[i], vocab_size)] = True

    logit_bias = None
    if any(p.logit_bias for p in params) or any(extra_bias):
        logit_bias = np.zeros((padded_size, vocab_size), np.float32)
        for i, p in enumerate(params):
            for name, bias in (("logit_bias", p.logit_bias), (f"extra_bias[{i}]", extra_bias[i])):
                for token, value in (bias or {}).items():
                    _check(f"{name} token id", token, 0 <= int(token) < vocab_size, f"[0, {vocab_size})")
                    logit_bias[i, int(token)] += np.float32(value)

    requested = [vocab_size if p.logprobs == -1 else (p.logprobs or 0) for p in params]
    has_bias = column([bool(p.logit_bias) or bool(extra_bias[i]) for i, p in enumerate(params)], False, bool)
    return SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=column([p.top_p for p in params], 1.0, np.float32),
        min_p=column([p.min_p for p in params], 0.0, np.float32),
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        seeds=seeds_u32,
        steps=column(steps, 0, np.int32),
        requested_logprobs=column(requested, 0, np.int32),
        has_logit_bias=has_bias,
        output_counts=output_counts,
        prompt_mask=prompt_mask,
        logit_bias=logit_bias,
        all_greedy=bool(np.all(temperature[:n] < GREEDY_EPS)),
        num_logprobs=int(max(requested, default=0)),
    )
