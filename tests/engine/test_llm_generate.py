"""LLM.generate on tiny random checkpoints against transformers' greedy generate (fp32)."""

import functools

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.tiny_models import hf_model, tiny_checkpoint

MAX_TOKENS = 10


@functools.cache
def tiny_llm(arch: str = "llama", **kwargs) -> LLM:
    return LLM(tiny_checkpoint(arch), dtype="float32", block_size=8, num_gpu_blocks_override=96,
               max_model_len=256, compile_on_startup=False, **kwargs)


def hf_greedy(arch: str, prompt: list[int], max_tokens: int) -> list[int]:
    import torch

    model = hf_model(tiny_checkpoint(arch))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_top5(arch: str, tokens: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        logits = hf_model(tiny_checkpoint(arch))(torch.tensor([tokens])).logits[0, -1]
    return torch.topk(logits, 5).indices.tolist()


def assert_same_greedy(arch, prompt, ours_ids, ours_logprobs, ref_ids):
    """Token for token; at a near-tie flip, each side's token must be in the other's top 5."""
    for i, (a, b) in enumerate(zip(ours_ids, ref_ids)):
        if a != b:
            assert b in ours_logprobs[i], f"step {i}: transformers' {b} not in our top-5 {list(ours_logprobs[i])}"
            assert a in hf_top5(arch, prompt + ref_ids[:i]), f"step {i}: our {a} not in transformers' top-5"
            return
    assert len(ours_ids) == len(ref_ids)


PROMPT_LENGTHS = [1, 8, 9, 16, 23, 5, 31]   # block size 8: on and just past block boundaries


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_greedy_matches_transformers_per_prompt(arch):
    llm = tiny_llm(arch)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 320, n).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS
        assert_same_greedy(arch, prompt, completion.token_ids, completion.logprobs,
                           hf_greedy(arch, prompt, MAX_TOKENS))
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_text_prompts_outputs_in_input_order_and_text_decodes_tokens():
    llm = tiny_llm()
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "Hello", "Paged attention keeps the KV cache in fixed-size blocks."]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.prompt == prompt and out.finished
        assert out.prompt_token_ids == tok.encode(prompt)
        c = out.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.index == 0 and c.stop_reason is None


def test_seeded_sampling_is_reproducible_alone_and_in_any_batch():
    llm = tiny_llm()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 42, 9]}
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": [7] * 12}, prompt, {"prompt_token_ids": [3, 4]}],
                         [other, seeded, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = [llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1], "unseeded requests should draw fresh randomness"


def test_a_top_k_past_the_vocabulary_keeps_every_token_however_large():
    """top_k >= the vocabulary truncates nothing, as top_k=-1, up to integers no array holds (a fuzzer
    sent 2**31 over HTTP and the step failed packing it into int32)."""
    llm = tiny_llm()
    prompt = {"prompt_token_ids": [5, 17, 42, 9]}
    outs = [llm.generate(prompt, SamplingParams(temperature=1.0, top_k=k, seed=7, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for k in (-1, 2**31, 2**70)]
    assert outs[0] == outs[1] == outs[2]


def test_the_text_leaves_out_the_token_that_stopped_it():
    """As vLLM's: an EOS (even with skip_special_tokens=False) or a stop_token_ids token that ends a sequence
    is not in its text, unless include_stop_str_in_output; its id stays in token_ids."""
    llm = tiny_llm()
    tokenizer = llm.get_tokenizer()
    free = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[3]
    cut = free.token_ids.index(stop_id)
    for keep in (False, True):
        out = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                         stop_token_ids=[stop_id], include_stop_str_in_output=keep),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids[-1] == stop_id and out.stop_reason == stop_id
        assert out.text == tokenizer.decode(free.token_ids[:cut + keep], skip_special_tokens=True)
    eos = tokenizer.eos_token_id
    for keep in (False, True):   # the EOS forced as the third token, special tokens kept in the text
        out = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=6, min_tokens=2,
                                                         logit_bias={eos: 100.0}, skip_special_tokens=False,
                                                         include_stop_str_in_output=keep),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids[-1] == eos and out.finish_reason == "stop" and len(out.token_ids) == 3
        assert out.text.endswith(tokenizer.eos_token) is keep


def test_stop_strings_stop_token_ids_and_min_tokens():
    llm = tiny_llm()
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = "Hello world"
    free = llm.generate(prompt, base, use_tqdm=False)[0].outputs[0]
    # stop on the third generated token's id
    stop_id = free.token_ids[2]
    first = free.token_ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens masks the stop token until reached
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_id], min_tokens=first + 2),
                       use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:first + 2]
    # a stop string taken from the free-running text
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop.strip():
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[:text.index(stop)]
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
        assert out.text == text[:text.index(stop) + len(stop)]


def test_prompt_logprobs_match_transformers():
    import torch

    llm = tiny_llm()
    prompt = [5, 17, 42, 9, 100, 250, 31, 8, 77, 12]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(tiny_checkpoint("llama"))(torch.tensor([prompt])).logits[0], -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]]) < 1e-4
        assert entry[prompt[i]].rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
        assert set(np.argsort(-ref[i - 1])[:2]) <= set(entry)


@pytest.mark.parametrize("prompt_len", [5, 8, 14])
def test_greedy_forks_decode_what_one_sequence_decodes(prompt_len):
    """n > 1 greedy: every fork reads its parent's K/V through its own block table (forked mid-block,
    at a block's start and at its last slot; the parent copies its shared tail first), so each
    sequence is transformers' greedy output, logprobs too."""
    llm = tiny_llm()
    prompt = list(range(7, 7 + prompt_len))
    ref = hf_greedy("llama", prompt, MAX_TOKENS)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS,
                                                                    ignore_eos=True, logprobs=1), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [ref] * 3
    first = [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in out.outputs]
    np.testing.assert_allclose(first[1:], [first[0]] * 2, atol=1e-6)


def test_n_samples_and_chat():
    llm = tiny_llm()
    out = llm.generate("Hello", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    chat = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0.0, max_tokens=4),
                    use_tqdm=False)[0]
    assert chat.prompt == "user: Hello\nassistant:"


@pytest.mark.parametrize("params,field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(n=0), "n"),
])
def test_bad_sampling_params_raise_value_error_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


def test_bad_prompts_raise_and_leave_the_engine_usable():
    llm = tiny_llm()
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 300}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [100000]}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_chat_tools_go_through_the_template():
    from tests.server.test_tool_calls import TEMPLATE, TOOLS
    llm = LLM(tiny_checkpoint("llama", max_position_embeddings=1024), dtype="float32", max_model_len=1024,
              num_gpu_blocks_override=256, compile_on_startup=False)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "20C"}]
    out = llm.chat(history, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False, chat_template=TEMPLATE,
                   tools=TOOLS)[0]
    assert out.prompt.startswith("<tools>") and '"name": "get_time"' in out.prompt
    # arguments sent as a JSON string reach the template as an object, as in the server
    assert '"arguments": {"city": "Rome"}}</tool_call>' in out.prompt
