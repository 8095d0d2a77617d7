"""Sequence classifiers under runner="pooling" (vLLM's classify and cross-encoder score): LLM.classify
and LLM.score against transformers' *ForSequenceClassification on the same tiny checkpoints, fp32, through
chunked prefill and the prefix cache; the logits' activations; the head's weight updates; the errors."""

import functools
import json
import os
import shutil
import types

import numpy as np
import pytest

from jaxpaged import LLM, PoolingParams
from tests.tiny_models import tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100], list(range(3, 60)), [7], list(range(3, 60)) + [11, 12]]
LABELS = ("negative", "neutral", "positive")


def checkpoint(arch: str, num_labels: int) -> str:
    return tiny_checkpoint(arch, head="ForSequenceClassification", labels=LABELS if num_labels == 3 else ("relevant",))


@functools.cache
def cross_encoder() -> str:
    """The one-label qwen2 classifier with a tokenizer that marks pairs as rerankers' do: <s> A </s> B </s>."""
    import tokenizers

    from tests.tiny_models import scratch_folder, tiny_tokenizer

    folder = os.path.join(scratch_folder("cross-encoder-"), "model")
    shutil.copytree(checkpoint("qwen2", 1), folder)
    tokenizer = tiny_tokenizer()
    tokenizer = type(tokenizer)(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
                                pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.backend_tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer.save_pretrained(folder)
    return folder


@functools.cache
def classifier(arch: str = "llama", num_labels: int = 3) -> LLM:
    # a 16-token budget: the 57- and 59-token prompts come in chunks; the 4th shares the 2nd's blocks
    path = cross_encoder() if (arch, num_labels) == ("qwen2", 1) else checkpoint(arch, num_labels)
    return LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=64,
               max_model_len=128, max_num_batched_tokens=16, compile_on_startup=False)


@functools.cache
def hf_classifier(path: str):
    import torch
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path: str, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_classifier(path)(torch.tensor([prompt])).logits[0].numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])   # gpt2: its final LayerNorm's bias, learned positions
def test_class_probabilities_match_transformers_through_chunks_and_the_prefix_cache(arch):
    llm, path = classifier(arch), checkpoint(arch, 3)
    assert llm.llm_engine.args.runner == "pooling"   # "auto": a classifier has no LM head to generate with
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.finished and out.prompt_token_ids == prompt and out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, softmax(hf_logits(path, prompt)), atol=2e-6)
    raw = llm.encode({"prompt_token_ids": PROMPTS[1]}, PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert isinstance(raw.outputs.data, np.ndarray) and raw.num_cached_tokens > 0   # its blocks cached now
    np.testing.assert_allclose(raw.outputs.data, hf_logits(path, PROMPTS[1]), rtol=1e-5, atol=1e-5)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_cross_encoder_scores_pairs_as_transformers_reads_them():
    """One label: LLM.score reads each pair as one sequence (the tokenizer's pair encoding) and gives the
    sigmoid of its logit, 1 to N and N to N, texts or token ids; classify gives the same probability."""
    llm, path = classifier("qwen2", 1), checkpoint("qwen2", 1)
    tokenizer = llm.get_tokenizer()
    query, docs = "The capital of France", ["is Paris.", "Hello world!", "Paged attention keeps blocks."]
    want = [float(sigmoid(hf_logits(path, tokenizer(query, text_pair=d)["input_ids"]))[0]) for d in docs]
    scores = llm.score(query, docs, use_tqdm=False)
    np.testing.assert_allclose([s.outputs.score for s in scores], want, atol=2e-6)
    joined = [1, *tokenizer.encode(query, add_special_tokens=False), 2, *tokenizer.encode(docs[0],
                                                                                          add_special_tokens=False), 2]
    assert scores[0].prompt_token_ids == joined   # the pair's template: <s> query </s> document </s>
    pairwise = llm.score([query, docs[0]], docs[1:], use_tqdm=False)
    np.testing.assert_allclose(pairwise[1].outputs.score, sigmoid(hf_logits(path, tokenizer(
        docs[0], text_pair=docs[2])["input_ids"]))[0], atol=2e-6)
    ids = llm.score([5, 6, 7], [[8, 9], [10]], use_tqdm=False)
    np.testing.assert_allclose(ids[1].outputs.score, sigmoid(hf_logits(path, [5, 6, 7, 10]))[0], atol=2e-6)
    probs = llm.classify({"prompt_token_ids": [5, 6, 7, 10]}, use_tqdm=False)[0].outputs.probs
    np.testing.assert_allclose(probs, [ids[1].outputs.score], atol=1e-7)
    cut = llm.score([5, 6, 7], [8, 9], truncate_prompt_tokens=3, use_tqdm=False)[0]
    assert cut.prompt_token_ids == [7, 8, 9]
    with pytest.raises(ValueError, match="both texts or both token-id lists"):
        llm.score("text", [[8, 9]], use_tqdm=False)


def test_the_activation_follows_the_config():
    from jaxpaged.pooling_params import classifier_activations

    logits = np.array([0.5, -1.0, 2.0], np.float32)

    def act(task="classify", **config):
        return classifier_activations(types.SimpleNamespace(num_labels=3, **config))[task](logits)

    np.testing.assert_allclose(act(), softmax(logits), rtol=1e-6)
    np.testing.assert_allclose(act(problem_type="multi_label_classification"), sigmoid(logits), rtol=1e-6)
    np.testing.assert_allclose(act(problem_type="regression"), logits)
    identity = {"activation_fn": "torch.nn.modules.linear.Identity"}
    np.testing.assert_allclose(act("score", sentence_transformers=identity), logits)
    np.testing.assert_allclose(act("score", sbert_ce_default_activation_function="torch.nn.modules.activation.Tanh"),
                               np.tanh(logits), rtol=1e-6)
    with pytest.raises(ValueError, match="activation_fn 'os.system' is not supported"):
        act(sentence_transformers={"activation_fn": "os.system"})


def test_update_weights_reaches_the_classifier_head():
    """A reward model trained on (RL): update_weights takes the head's `score.weight` as any other tensor."""
    llm, path = classifier(), checkpoint("llama", 3)
    before = hf_logits(path, PROMPTS[0])
    head = hf_classifier(path).score.weight.detach().numpy()
    raw = PoolingParams(use_activation=False)
    try:
        llm.update_weights([("score.weight", 2.0 * head)])
        out = llm.encode({"prompt_token_ids": PROMPTS[0]}, raw, use_tqdm=False)[0]
        np.testing.assert_allclose(out.outputs.data, 2.0 * before, rtol=1e-5, atol=1e-5)
    finally:
        llm.update_weights([("score.weight", head)])
    np.testing.assert_allclose(llm.encode({"prompt_token_ids": PROMPTS[0]}, raw, use_tqdm=False)[0].outputs.data,
                               before, rtol=1e-5, atol=1e-5)


def test_tasks_the_model_has_not_and_options_of_another_task_are_named():
    llm = classifier()
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(ValueError, match="task='embed': LlamaForSequenceClassification does not embed; supported "
                                         "tasks of this model: classify"):
        llm.embed(prompt, use_tqdm=False)
    with pytest.raises(ValueError, match="task='score': .* supported tasks of this model: classify"):
        llm.score([5, 6], [7, 8], use_tqdm=False)
    with pytest.raises(ValueError, match="normalize applies to the embed task, not classify; allowed: None"):
        llm.classify(prompt, pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task must be None or one of embed, classify, score"):
        llm.encode(prompt, pooling_task="reward", use_tqdm=False)
    with pytest.raises(ValueError, match="this engine runs runner='pooling'"):
        llm.generate(prompt, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="use_activation applies to the classify and score task, not embed"):
        from tests.engine.test_embed import embedder
        embedder().encode(prompt, PoolingParams(use_activation=False), use_tqdm=False)


def test_generate_refuses_a_classifier_and_a_head_without_labels_is_named(tmp_path):
    with pytest.raises(ValueError, match="runner='generate' needs a model with an LM head; "
                                         "LlamaForSequenceClassification has none"):
        LLM(checkpoint("llama", 3), runner="generate", dtype="float32", compile_on_startup=False)
    folder = tmp_path / "no-labels"
    shutil.copytree(checkpoint("llama", 3), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "id2label": {}, "label2id": {}}))
    with pytest.raises(ValueError, match="LlamaForSequenceClassification needs num_labels >= 1 in its config"):
        LLM(str(folder), dtype="float32", compile_on_startup=False)
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForSequenceClassification"]}))
    with pytest.raises(ValueError, match="architecture 'MambaForSequenceClassification' is not supported"):
        LLM(str(folder), dtype="float32", compile_on_startup=False)
