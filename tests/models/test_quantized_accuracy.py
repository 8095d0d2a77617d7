"""#16's accuracy goals on the built-in model's real weights (the first 1,024 tokens of the shipped
English text; `python -m jaxpaged.bench.quantization` measures the whole text, agreement and speed):
perplexity over fp32 within +1% for int8 and the fp8 KV cache (calibrated scales), +2% for fp8,
GGUF's blocks kept give fp32's own (the same values), and the chat answer names Paris in every mode."""

import functools

import pytest

from jaxpaged.bench import quantization as bench

# the fp8 KV goal (+1%) holds with calculate_kv_scales; at the default scales of 1.0 the whole text gives +1.05%
GOALS = {"gguf": 0.001, "int8": 0.01, "fp8": 0.02, "fp8-kv-calibrated": 0.01, "fp8-kv": 0.02, "int4": 0.05}


@functools.cache
def measured(name: str) -> tuple[float, str]:
    llm = bench.make_llm(bench.MODES[name], compile_on_startup=False, max_model_len=1100)
    tokens = bench.text_tokens(llm, limit=bench.WINDOW)
    return bench.perplexity(llm, tokens), bench.chat_answer(llm)


@pytest.mark.parametrize("name", list(GOALS))
def test_perplexity_within_the_goal_and_paris_in_every_mode(name):
    fp32, fp32_answer = measured("fp32")
    ppl, answer = measured(name)
    assert "Paris" in fp32_answer and "Paris" in answer, answer
    assert 5 < fp32 < 60   # a real model on English text
    assert ppl / fp32 - 1 <= GOALS[name], (name, ppl, fp32)
