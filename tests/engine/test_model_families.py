"""The families beyond Llama's (Phi-3, Gemma, Granite, OLMo, SmolLM3, EXAONE, ERNIE, the MoEs) in the engine:
greedy tokens and logprobs equal transformers' (fp32) with prefix caching and chunked prefill at work;
LoRA equals peft's."""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.engine.test_llm_generate import assert_same_greedy, hf_greedy
from tests.tiny_models import FAMILIES, hf_model, tiny_checkpoint

MAX_TOKENS = 8


def hf_logprobs(arch: str, tokens: list[int], num_prompt: int) -> np.ndarray:
    """transformers' log-probabilities of each generated token (tokens = prompt + generated)."""
    import torch

    with torch.no_grad():
        logits = hf_model(tiny_checkpoint(arch))(torch.tensor([tokens])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1).numpy()
    return np.array([logprobs[i - 1, tokens[i]] for i in range(num_prompt, len(tokens))])


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers_with_prefix_caching_and_chunked_prefill(arch):
    # 12 tokens a step: the 30-token prompts prefill in chunks; the shared 24-token prefix hits the
    # prefix cache on the second pass; gemma's 12-token sliding window is outgrown
    llm = LLM(tiny_checkpoint(arch), dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128,
              max_num_batched_tokens=12, compile_on_startup=False)
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 320, 24).tolist()
    prompts = [prefix + rng.integers(3, 320, n).tolist() for n in (6, 9)] + [rng.integers(3, 320, 5).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["jaxpaged:prefix_cache_hits_total"] > 0
    for prompt, out, repeat in zip(prompts, first, again):
        c = out.outputs[0]
        assert repeat.outputs[0].token_ids == c.token_ids   # through the cached prefix
        ref = hf_greedy(arch, prompt, MAX_TOKENS)
        assert_same_greedy(arch, prompt, c.token_ids, c.logprobs, ref)
        if c.token_ids == ref:
            ours = np.array([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
            np.testing.assert_allclose(ours, hf_logprobs(arch, prompt + ref, len(prompt)), atol=2e-4)
    assert metrics["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_moe_refuses_what_it_does_not_run_yet():
    with pytest.raises(ValueError, match="scan_layers=True needs layers of one shape"):
        LLM(tiny_checkpoint("qwen2_moe"), dtype="float32", scan_layers=True, compile_on_startup=False)
    with pytest.raises(ValueError, match="enable_lora does not yet support MixtralForCausalLM"):
        LLM(tiny_checkpoint("mixtral"), dtype="float32", enable_lora=True, compile_on_startup=False)
    llm = LLM(tiny_checkpoint("mixtral"), dtype="float32", block_size=8, num_gpu_blocks_override=16,
              max_model_len=64, compile_on_startup=False)
    with pytest.raises(ValueError, match="update_weights does not yet take MixtralForCausalLM"):
        llm.update_weights({"model.norm.weight": np.ones(64, np.float32)})


# each family's linears: fused ones split (Phi-3's qkv_proj and gate_up_proj, GLM-4's gate_up_proj, GPT-2's Conv1D
# c_attn, NeoX's per-head query_key_value), an interleaved rope's q/k rows reordered (GLM-4, GPT-J's partial one)
LORA_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                "glm4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
                "gpt2": ["c_attn", "c_proj", "c_fc"], "gpt_bigcode": ["c_attn", "c_proj", "c_fc"],
                "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
                "falcon": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
                "gptj": ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"]}


@pytest.mark.parametrize("arch", ["granite", "olmo2", *LORA_TARGETS])
def test_lora_on_every_projection_of_each_family(arch):
    """An adapter on every projection equals peft's where the family scales the residual branches
    (Granite), norms q/k over all heads after q_proj / k_proj (OLMo 2), or names, fuses or orders its
    linears its own way (`LORA_TARGETS`)."""
    import peft
    import torch
    import transformers

    from jaxpaged import LoRARequest
    from tests.engine.test_lora import adapter as random_adapter

    path = tiny_checkpoint(arch)
    adapter = random_adapter(0, arch=arch, **({"targets": tuple(LORA_TARGETS[arch])} if arch in LORA_TARGETS else {}))
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32), adapter).eval()
    tokens = np.random.default_rng(1).integers(3, 320, 12).tolist()
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            tokens.append(int(torch.argmax(model(input_ids=torch.tensor([tokens])).logits[0, -1])))
    llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64, enable_lora=True,
              max_lora_rank=8, compile_on_startup=False)
    out = llm.generate([{"prompt_token_ids": tokens[:12]}], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                           ignore_eos=True),
                       lora_request=LoRARequest("a", 1, adapter), use_tqdm=False)
    assert out[0].outputs[0].token_ids == tokens[12:]


def test_yarn_lengthens_the_context_past_max_position_embeddings():
    """Qwen's long-context setting (yarn, factor 4 over 32 original positions, max_position_embeddings left at
    32): the engine takes 128-token sequences, as vLLM does, and refuses a longer max_model_len naming why."""
    path = tiny_checkpoint("qwen3", rope="yarn", max_position_embeddings=32)
    llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=32, compile_on_startup=False)
    assert llm.llm_engine.max_model_len == 128
    with pytest.raises(ValueError, match=r"max_model_len \(129\) .* scaled by its yarn rope \(128\)"):
        LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=129,
            compile_on_startup=False)


def test_gpt_oss_runs_on_the_mosaic_gpu_kernel_with_its_sinks():
    """The sinks reach a Pallas kernel too (Mosaic GPU, in GPU interpret mode here): transformers' greedy
    tokens and logprobs."""
    arch = "gpt_oss"
    llm = LLM(tiny_checkpoint(arch), dtype="float32", attention_backend="pallas", block_size=16,
              num_gpu_blocks_override=16, max_model_len=64, max_num_seqs=2, compile_on_startup=False)
    prompt = np.random.default_rng(5).integers(3, 320, 20).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=1)
    c = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ref = hf_greedy(arch, prompt, 4)
    assert c.token_ids == ref
    ours = np.array([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    np.testing.assert_allclose(ours, hf_logprobs(arch, prompt + ref, len(prompt)), atol=2e-4)
