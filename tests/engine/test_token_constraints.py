"""vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens against transformers' greedy
generate with the same constraint (fp32, a tiny random checkpoint and its tokenizer)."""

import numpy as np
import pytest

from jaxpaged import SamplingParams
from tests.engine.test_llm_generate import tiny_llm
from tests.tiny_models import hf_model, tiny_checkpoint

PROMPT = [5, 17, 42, 9, 100, 250, 31]
MAX_TOKENS = 12


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kwargs})


def hf_constrained(prompt: list[int], **generate_kwargs) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf_model(tiny_checkpoint("llama")).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            **generate_kwargs)
    return out[0, len(prompt):].tolist()


def tokens(llm, prompt, params) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


def test_allowed_token_ids_match_transformers_and_leave_other_rows_alone():
    llm = tiny_llm()
    free = tokens(llm, PROMPT, greedy())
    allowed = sorted(set(range(3, 320, 7)) - set(free[:3]))   # the free answer's first tokens are not allowed
    want = hf_constrained(PROMPT, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [greedy(allowed_token_ids=allowed), greedy()],
                        use_tqdm=False)
    got = outs[0].outputs[0].token_ids
    assert got == want and set(got) <= set(allowed)
    assert outs[1].outputs[0].token_ids == free


def word_from(llm, output: list[int], length: int) -> str:
    """A word of `length` tokens taken from an output: a text whose tokenization (plain or with a
    leading space) is that span of it, so that banning it must change the output."""
    tok, processor = llm.get_tokenizer(), llm.llm_engine.input_processor
    for start in range(len(output) - length):
        span = output[start:start + length]
        word = tok.decode(span)
        if word.strip() and "\ufffd" not in word and span in processor.bad_words_token_ids([word]):
            return word
    raise AssertionError(f"no word of {length} tokens in the output {output}")


def test_bad_words_match_transformers_with_and_without_async_scheduling():
    """A one-token word taken from the free output, then a two-token word taken from the output that
    avoids the first: each ban changes the output, which is transformers' with the same bans."""
    llm = tiny_llm()
    processor = llm.llm_engine.input_processor
    free = tokens(llm, PROMPT, greedy())
    words = [word_from(llm, free, 1)]
    avoided = tokens(llm, PROMPT, greedy(bad_words=words))
    assert avoided == hf_constrained(PROMPT, bad_words_ids=processor.bad_words_token_ids(words)) != free
    words.append(word_from(llm, avoided, 2))
    ids = processor.bad_words_token_ids(words)
    # transformers bans a word's last token after its prefix anywhere in the input, vLLM in the output only:
    # the same here, as no prefix ends the prompt
    assert not any(len(w) > 1 and PROMPT[-(len(w) - 1):] == w[:-1] for w in ids)
    want = hf_constrained(PROMPT, bad_words_ids=ids)
    assert want != avoided
    for engine in (llm, tiny_llm(async_scheduling=False)):
        outs = engine.generate([{"prompt_token_ids": PROMPT}] * 2, [greedy(bad_words=words), greedy()],
                               use_tqdm=False)
        assert outs[0].outputs[0].token_ids == want
        assert outs[1].outputs[0].token_ids == free
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_sampling_among_allowed_tokens_keeps_their_distribution():
    """At temperature 1 the first token is drawn from the allowed tokens' renormalized probabilities
    (transformers' logits): frequencies within 4 sigma over 400 seeded draws."""
    import torch

    llm = tiny_llm()
    with torch.no_grad():
        logits = hf_model(tiny_checkpoint("llama"))(torch.tensor([PROMPT])).logits[0, -1].double().numpy()
    allowed = [int(t) for t in np.argsort(logits)[-3:]]   # the three likeliest: each drawn often enough
    probs = np.exp(logits[allowed] - logits[allowed].max())
    probs /= probs.sum()
    n = 400
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=i, allowed_token_ids=allowed, ignore_eos=True)
              for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n, params, use_tqdm=False)
    drawn = [o.outputs[0].token_ids for o in outs]
    assert all(set(d) <= set(allowed) for d in drawn)
    counts = np.array([sum(d[0] == t for d in drawn) for t in allowed])
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - n * probs) <= 4 * sigma + 1), (counts, n * probs)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens():
    llm = tiny_llm()
    long_prompt = list(np.random.default_rng(3).integers(3, 320, 300))   # max_model_len is 256
    out = llm.generate({"prompt_token_ids": long_prompt}, greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt[-5:]
    assert out.outputs[0].token_ids == tokens(llm, long_prompt[-5:], greedy())
    fit = llm.generate({"prompt_token_ids": long_prompt}, greedy(truncate_prompt_tokens=-1, max_tokens=1),
                       use_tqdm=False)[0]
    assert fit.prompt_token_ids == long_prompt[-255:] and len(fit.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="prompt is 300 tokens"):
        llm.generate({"prompt_token_ids": long_prompt}, greedy(), use_tqdm=False)


@pytest.mark.parametrize("kwargs,message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must be None or a non-empty list"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids must be >= 0"),
    (dict(allowed_token_ids=7), "allowed_token_ids must be None or a non-empty list"),
    (dict(bad_words=["ok", "  "]), "bad_words must contain non-empty strings"),
    (dict(bad_words=[3]), "bad_words must contain non-empty strings"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be an integer >= 1 or -1"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be an integer >= 1 or -1"),
    (dict(truncate_prompt_tokens=2.5), "truncate_prompt_tokens must be an integer"),
])
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_past_the_vocabulary_queue_nothing():
    llm = tiny_llm()
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"allowed_token_ids token id 320 is out of range \[0, 320\)"):
        engine.add_request("past", {"prompt_token_ids": PROMPT}, greedy(allowed_token_ids=[5, 320]))
    word = word_from(llm, list(range(60, 320)), 1)   # a token that is a word of its own
    token = engine.input_processor.bad_words_token_ids([word])[0][0]
    with pytest.raises(ValueError, match="allowed_token_ids leaves no token to sample: bad_words bans every one"):
        engine.add_request("none", {"prompt_token_ids": PROMPT}, greedy(allowed_token_ids=[token], bad_words=[word]))
    assert not engine.has_unfinished_requests()
    assert SamplingParams(bad_words="Paris").bad_words == ["Paris"]   # one word, as stop takes one string


@pytest.mark.parametrize("extreme", [dict(temperature=1e38), dict(temperature=1e39),
                                     dict(temperature=1.0, repetition_penalty=1e-38)])
def test_masked_tokens_stay_masked_at_extreme_temperatures_and_penalties(extreme):
    """A temperature past float32's reciprocal range, or a repetition penalty float32 flushes to 0, once
    turned the masks' -inf into NaNs that the argmax picked (a fuzzer's find)."""
    llm = tiny_llm()
    allowed = [5, 6]
    banned = tokens(llm, PROMPT, greedy())[0]
    params = [SamplingParams(max_tokens=6, seed=i, ignore_eos=True, allowed_token_ids=allowed, **extreme)
              for i in range(4)]
    params += [SamplingParams(max_tokens=6, seed=i, ignore_eos=True, logit_bias={banned: -100}, min_tokens=6,
                              stop_token_ids=[banned], **extreme) for i in range(4)]
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": PROMPT}] * 8, params, use_tqdm=False)]
    assert all(set(o) <= set(allowed) for o in outs[:4]), outs[:4]
    assert all(banned not in o and len(o) == 6 for o in outs[4:]), outs[4:]
