"""A sequence classifier served with --runner pooling (the default for one): /classify gives each input's
(or a conversation's) class probabilities and its label, as transformers' *ForSequenceClassification; a
cross-encoder (one label) answers /score and /rerank with its score of each pair; the routes a model does
not serve are 400s naming it."""

import numpy as np
import pytest

from tests.engine.test_classify import LABELS, checkpoint, cross_encoder, hf_logits, sigmoid, softmax
from tests.server.helpers import HTTP, MODEL, gauge, serving_tiny_engine, wait_idle


@pytest.fixture(scope="module")
def url():
    with serving_tiny_engine(model=checkpoint("llama", 3), max_num_batched_tokens=16) as url:
        yield url


@pytest.fixture(scope="module")
def reranker():
    with serving_tiny_engine(model=cross_encoder()) as url:
        yield url


def test_classify_inputs_and_a_conversation_as_transformers(url):
    path = checkpoint("llama", 3)
    prompts = [[5, 17, 42, 9, 100], list(range(3, 40))]
    out = HTTP.post(url + "/classify", json={"model": MODEL, "input": prompts}).json()
    assert out["object"] == "list" and out["model"] == MODEL and [d["index"] for d in out["data"]] == [0, 1]
    for prompt, item in zip(prompts, out["data"]):
        want = softmax(hf_logits(path, prompt))
        np.testing.assert_allclose(item["probs"], want, atol=2e-6)
        assert item["num_classes"] == 3 and item["label"] == LABELS[int(np.argmax(want))]
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == 5 + 37
    messages = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "How are you?"}]
    ids = HTTP.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    chat = HTTP.post(url + "/v1/classify", json={"messages": messages, "use_activation": False}).json()
    np.testing.assert_allclose(chat["data"][0]["probs"], hf_logits(path, ids), rtol=1e-5, atol=1e-5)   # logits
    text = HTTP.post(url + "/classify", json={"input": "Hello world", "truncate_prompt_tokens": 2}).json()
    assert text["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("route, body, param, message", [
    ("/classify", {"messages": []}, "messages", "messages"),
    ("/classify", {}, "input", "input"),
    ("/classify", {"input": [[1, 2], [10**9]]}, "input", "out of range"),
    ("/classify", {"input": [1, 2], "use_activation": "yes"}, "use_activation", "use_activation"),
    ("/classify", {"input": [1, 2], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": [1, 2]}, None, "does not support Embeddings API: LlamaForSequenceClassification "
                                                "serves classify"),
    ("/score", {"text_1": "a", "text_2": "b"}, None, "does not support Score API"),
    ("/v1/completions", {"prompt": "Hi"}, None, "runner='pooling'"),
])
def test_bad_bodies_and_other_tasks_are_400s_naming_them(url, route, body, param, message):
    reply = HTTP.post(url + route, json=body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and message in error["message"], error


def test_a_cross_encoder_scores_and_reranks_pairs(reranker):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cross_encoder())
    path = checkpoint("qwen2", 1)
    query, docs = "The capital of France", ["is Paris.", "Hello world!", "Paged attention keeps blocks."]
    want = [float(sigmoid(hf_logits(path, tokenizer(query, text_pair=d)["input_ids"]))[0]) for d in docs]
    score = HTTP.post(reranker + "/v1/score", json={"text_1": query, "text_2": docs}).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=2e-6)
    assert score["usage"]["prompt_tokens"] == sum(len(tokenizer(query, text_pair=d)["input_ids"]) for d in docs)
    rerank = HTTP.post(reranker + "/rerank", json={"query": query, "documents": docs, "top_n": 2}).json()["results"]
    assert [r["index"] for r in rerank] == list(np.argsort(want)[::-1][:2])
    np.testing.assert_allclose([r["relevance_score"] for r in rerank], sorted(want)[::-1][:2], atol=2e-6)
    one = HTTP.post(reranker + "/classify", json={"input": [5, 6, 7]}).json()["data"][0]
    assert one["label"] == "relevant" and one["num_classes"] == 1


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_classify_requests_get_answers_or_openai_errors(url, mode):
    from schemathesis import GenerationMode

    from tests.server.test_fuzz import fuzz

    seen = fuzz(url, "/v1/classify", GenerationMode(mode), 25)
    assert len(seen) >= 12
    assert gauge(wait_idle(url), "kv_cache_usage_perc") == 0.0
    assert HTTP.post(url + "/classify", json={"input": "Hello"}).status_code == 200
