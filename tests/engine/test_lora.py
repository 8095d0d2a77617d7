"""Multi-LoRA against transformers + peft on the same tiny checkpoint and adapters (fp32): greedy
tokens and logprobs equal, mixed batches give each request what it gets alone, adapters beyond
max_loras wait, adapters come and go while serving, the prefix cache is keyed by adapter,
nothing compiles when adapters change, and bad adapters are ValueErrors that lose nothing."""

import functools
import os

import numpy as np
import pytest

from jaxpaged import LLM, BeamSearchParams, LoRARequest, SamplingParams
from tests.engine.test_no_compiles_after_startup import compilations
from tests.tiny_models import hf_model, scratch_folder, tiny_checkpoint

ARCH = "qwen2"   # q/k/v bias, untied LM head
QV = ["q_proj", "v_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 8


@functools.cache
def adapter(seed: int, targets: tuple[str, ...] = tuple(ALL), rank: int = 8, alpha: int = 16,
            use_rslora: bool = False, arch: str = ARCH) -> str:
    """A random PEFT LoRA adapter folder for the tiny checkpoint of `arch` (both A and B random, large
    enough to change greedy tokens)."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             init_lora_weights=False, use_rslora=use_rslora)
    model = peft.get_peft_model(base, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    path = scratch_folder(f"lora-{arch}-{seed}-")
    model.save_pretrained(path)
    return path


@functools.cache
def peft_model(path: str):
    import peft

    return peft.PeftModel.from_pretrained(hf_model(tiny_checkpoint(ARCH)).__class__.from_pretrained(
        tiny_checkpoint(ARCH)), path).eval()


def oracle(path: str | None, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers (+ peft with the adapter at `path`)."""
    import torch

    model = hf_model(tiny_checkpoint(ARCH)) if path is None else peft_model(path)
    tokens = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            token = int(torch.argmax(lp))
            tokens.append(token)
            logprobs.append(float(lp[token]))
    return tokens[len(prompt):], logprobs


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


def prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 320, int(k)).tolist() for k in rng.integers(3, 30, n)]


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_checkpoint(ARCH), dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128,
               max_num_seqs=8, max_num_batched_tokens=64, enable_lora=True, max_loras=3, max_lora_rank=8,
               use_tqdm=False)


def tokens_and_logprobs(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def assert_same(out, want: tuple[list[int], list[float]]) -> None:
    """The same greedy tokens, logprobs up to the rounding of another batch shape."""
    ids, lps = tokens_and_logprobs(out)
    assert ids == want[0]
    np.testing.assert_allclose(lps, want[1], atol=1e-4)


def lora(i: int, **kw) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i, adapter(i, **kw))


@pytest.mark.parametrize("targets", [tuple(QV), tuple(ALL)], ids=["q_v", "all"])
def test_adapter_outputs_equal_transformers_peft(llm, targets):
    request = LoRARequest("t", 10 + len(targets), adapter(len(targets), targets))
    for prompt, out in zip(prompts(), llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS,
                                                   use_tqdm=False, lora_request=request)):
        ids, lps = tokens_and_logprobs(out)
        ref_ids, ref_lps = oracle(request.lora_path, prompt)
        assert ids == ref_ids
        np.testing.assert_allclose(lps, ref_lps, atol=2e-4)
        assert out.lora_request == request
    base_ids, _ = oracle(None, prompts()[0])
    assert base_ids != oracle(request.lora_path, prompts()[0])[0]   # the adapter changes the answer


def test_rslora_scaling_and_a_smaller_rank_equal_peft(llm):
    path = adapter(7, tuple(QV), rank=4, alpha=8, use_rslora=True)
    out = llm.generate({"prompt_token_ids": prompts()[1]}, PARAMS, use_tqdm=False,
                       lora_request=LoRARequest("rs", 7, path))[0]
    ids, lps = tokens_and_logprobs(out)
    ref_ids, ref_lps = oracle(path, prompts()[1])
    assert ids == ref_ids
    np.testing.assert_allclose(lps, ref_lps, atol=2e-4)


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(llm):
    ps = prompts(8, seed=3)
    loras = [None, lora(1), lora(2), lora(3)] * 2
    alone = [tokens_and_logprobs(llm.generate({"prompt_token_ids": p}, PARAMS, use_tqdm=False, lora_request=r)[0])
             for p, r in zip(ps, loras)]
    with compilations() as compiled:
        mixed = llm.generate([{"prompt_token_ids": p} for p in ps], PARAMS, use_tqdm=False, lora_request=loras)
    for want, out in zip(alone, mixed):
        assert_same(out, want)
    assert compiled == []   # adapters written into slots: values change, nothing compiles


def test_more_adapters_than_max_loras_wait_their_turn(llm):
    ps = prompts(5, seed=4)
    loras = [lora(1), lora(2), lora(3), lora(4), lora(5)]   # max_loras is 3
    alone = [tokens_and_logprobs(llm.generate({"prompt_token_ids": p}, PARAMS, use_tqdm=False, lora_request=r)[0])
             for p, r in zip(ps, loras)]
    engine = llm.llm_engine
    seen = []
    original = engine.assign_loras

    def spy(plan):
        seen.append({c.request.lora_int_id for c in plan.chunks} - {0})
        original(plan)

    engine.assign_loras = spy
    try:
        mixed = llm.generate([{"prompt_token_ids": p} for p in ps], PARAMS, use_tqdm=False, lora_request=loras)
    finally:
        del engine.assign_loras
    for want, out in zip(alone, mixed):
        assert_same(out, want)
    assert max(map(len, seen)) == 3 and set().union(*seen) == {1, 2, 3, 4, 5}
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"


def test_adapters_added_and_removed_while_serving(llm):
    engine = llm.llm_engine
    a, b = lora(1), lora(6)
    want_a = tokens_and_logprobs(llm.generate({"prompt_token_ids": prompts()[0]}, PARAMS, use_tqdm=False,
                                              lora_request=a)[0])
    want_b = tokens_and_logprobs(llm.generate({"prompt_token_ids": prompts()[1]}, PARAMS, use_tqdm=False,
                                              lora_request=b)[0])
    assert llm.remove_lora(6) and 6 not in llm.list_loras()
    engine.add_request("a", {"prompt_token_ids": prompts()[0]}, PARAMS, lora_request=a)
    done = {}
    for _ in range(3):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert llm.add_lora(b) and 6 in llm.list_loras()
    engine.add_request("b", {"prompt_token_ids": prompts()[1]}, PARAMS, lora_request=b)
    assert llm.remove_lora(1)   # "a" is running with it: it finishes with it
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert_same(done["a"], want_a)
    assert_same(done["b"], want_b)
    assert not llm.remove_lora(1)


def test_the_prefix_cache_is_keyed_by_adapter(llm):
    prompt = {"prompt_token_ids": list(range(3, 43))}   # 5 full blocks
    base = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    first = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=lora(2))[0]
    again = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=lora(2))[0]
    other = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=lora(3))[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0   # not the base model's K/V
    assert again.num_cached_tokens > 0 and tokens_and_logprobs(again)[0] == tokens_and_logprobs(first)[0]
    assert tokens_and_logprobs(first)[0] == oracle(adapter(2), prompt["prompt_token_ids"])[0]
    assert tokens_and_logprobs(base)[0] == oracle(None, prompt["prompt_token_ids"])[0]


def test_beam_search_and_n_take_the_adapter(llm):
    prompt = prompts()[2]
    greedy = llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False, lora_request=lora(1))[0]
    base = llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0]
    beam = BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    beams = llm.beam_search([{"prompt_token_ids": prompt}], beam, lora_request=lora(1))
    assert beams[0].sequences[0].tokens[len(prompt):] == greedy.outputs[0].token_ids
    per_prompt = llm.beam_search([{"prompt_token_ids": prompt}] * 2, beam, lora_request=[None, lora(1)])
    assert [b.sequences[0].tokens[len(prompt):] for b in per_prompt] == [base.outputs[0].token_ids,
                                                                         greedy.outputs[0].token_ids]
    n2 = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True),
                      use_tqdm=False, lora_request=lora(1))[0]
    assert all(c.token_ids == greedy.outputs[0].token_ids for c in n2.outputs)


def _write_adapter_config(path: str, **changes) -> str:
    import json
    import shutil

    bad = scratch_folder("bad-lora-")
    for name in os.listdir(path):
        shutil.copy(os.path.join(path, name), bad)
    with open(os.path.join(bad, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(bad, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return bad


def test_bad_adapters_are_value_errors_that_lose_nothing(llm):
    engine = llm.llm_engine
    cases = [
        (LoRARequest("missing", 50, "/no/such/adapter"), "adapter_config.json"),
        (LoRARequest("dora", 51, _write_adapter_config(adapter(1), use_dora=True)), "use_dora"),
        (LoRARequest("big", 52, adapter(8, tuple(QV), rank=16, alpha=16)), "max_lora_rank"),
        (LoRARequest("same-id", 1, adapter(2)), "lora_int_id 1"),
    ]
    llm.add_lora(lora(1))
    for request, words in cases:
        with pytest.raises(ValueError, match=words):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, PARAMS, use_tqdm=False, lora_request=request)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, adapter(1))
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], PARAMS, use_tqdm=False, lora_request=[lora(1)])
    assert not engine.has_unfinished_requests()
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"
    out = llm.generate({"prompt_token_ids": prompts()[0]}, PARAMS, use_tqdm=False, lora_request=lora(1))[0]
    assert tokens_and_logprobs(out)[0] == oracle(adapter(1), prompts()[0])[0]


def test_an_engine_without_enable_lora_refuses_adapters():
    from tests.engine.test_llm_generate import tiny_llm

    with pytest.raises(ValueError, match="enable_lora=True"):
        tiny_llm("qwen2").generate([5, 6, 7], PARAMS, use_tqdm=False, lora_request=lora(1))
    with pytest.raises(ValueError, match="max_loras"):
        LLM(tiny_checkpoint(ARCH), enable_lora=True, max_loras=0)


def test_an_id_removed_and_added_again_with_another_folder_is_the_new_adapter(llm):
    prompt = {"prompt_token_ids": list(range(3, 43))}
    first = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=LoRARequest("x", 30, adapter(1)))[0]
    assert llm.remove_lora(30)
    second = llm.generate(prompt, PARAMS, use_tqdm=False, lora_request=LoRARequest("x", 30, adapter(2)))[0]
    assert second.num_cached_tokens == 0   # not the first folder's K/V
    assert tokens_and_logprobs(first)[0] == oracle(adapter(1), prompt["prompt_token_ids"])[0]
    assert tokens_and_logprobs(second)[0] == oracle(adapter(2), prompt["prompt_token_ids"])[0]
