"""/v1/embeddings on a server with --runner pooling, with the official client (which asks base64): each
input's embedding is transformers' last hidden state, normalized; bad bodies are 400s naming the field,
and the generation routes say this model does not generate."""

import numpy as np
import pytest

from tests.engine.test_embed import hf_last_hidden, unit
from tests.server.helpers import HTTP, MODEL, gauge, openai_client, serving_tiny_engine, wait_idle


@pytest.fixture(scope="module")
def url():
    with serving_tiny_engine(runner="pooling", max_num_batched_tokens=16) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai_client(url)


def test_embeddings_of_token_ids_and_texts_match_transformers(client, url):
    prompts = [[5, 17, 42, 9, 100], list(range(3, 40))]
    out = client.embeddings.create(model=MODEL, input=prompts)   # base64 on the wire, decoded by the client
    assert [d.index for d in out.data] == [0, 1] and out.model == MODEL
    for prompt, item in zip(prompts, out.data):
        np.testing.assert_allclose(item.embedding, unit(hf_last_hidden(prompt)), atol=2e-6)
    assert out.usage.prompt_tokens == out.usage.total_tokens == 5 + 37
    floats = HTTP.post(url + "/v1/embeddings", json={"input": prompts[0], "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    np.testing.assert_allclose(floats["data"][0]["embedding"], out.data[0].embedding, atol=1e-7)
    ids = HTTP.post(url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    text = client.embeddings.create(model=MODEL, input="Hello world").data[0].embedding
    np.testing.assert_allclose(text, unit(hf_last_hidden(ids)), atol=2e-6)
    cut = client.embeddings.create(model=MODEL, input=prompts[1], extra_body={"truncate_prompt_tokens": 4})
    assert cut.usage.prompt_tokens == 4
    np.testing.assert_allclose(cut.data[0].embedding, unit(hf_last_hidden(prompts[1][-4:])), atol=2e-6)


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "input"),
    ({"input": [1, 2], "dimensions": 8}, "dimensions", "does not support Matryoshka"),
    ({"input": [1, 2], "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"input": [1, 2], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"input": [[1, 2], [10**9]]}, "input", "out of range"),
    ({"input": [1, 2], "priority": 2}, "priority", "needs scheduling_policy='priority'"),
    ({"input": [1, 2], "model": "other"}, "model", "does not exist"),
])
def test_bad_embedding_bodies_are_400s_naming_the_field(url, body, param, message):
    reply = HTTP.post(url + "/v1/embeddings", json=body)
    error = reply.json()["error"]
    assert reply.status_code in (400, 404) and error["param"] == param and message in error["message"], error


def test_the_generation_routes_say_the_model_pools(url):
    for route, body in [("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
        reply = HTTP.post(url + route, json={**body, "max_tokens": 2})
        assert reply.status_code == 400 and "runner='pooling'" in reply.json()["error"]["message"]
    assert HTTP.post(url + "/v1/embeddings", json={"input": [5, 6]}).status_code == 200   # and it serves on


def test_embedding_requests_are_counted_in_metrics_with_no_generated_tokens(url):
    before = wait_idle(url)
    HTTP.post(url + "/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]}).raise_for_status()
    after = wait_idle(url)
    key = 'jaxpaged:request_prompt_tokens_{}{{model_name="' + MODEL + '"}}'
    assert after[key.format("count")] - before[key.format("count")] == 2
    assert after[key.format("sum")] - before[key.format("sum")] == 5
    assert gauge(after, "generation_tokens_total") == gauge(before, "generation_tokens_total") == 0
    assert after[key.replace("request_prompt_tokens", "e2e_request_latency_seconds").format("count")] > 0


def test_score_and_rerank_rank_by_cosine_similarity(url):
    texts = ["Hello world", "Hello there world", "completely different words"]
    ids = [HTTP.post(url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    vectors = [unit(hf_last_hidden(i)) for i in ids]
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    score = HTTP.post(url + "/v1/score", json={"text_1": texts[0], "text_2": texts[1:]}).json()
    assert [d["index"] for d in score["data"]] == [0, 1] and score["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
    assert score["usage"]["prompt_tokens"] == sum(map(len, ids))
    pairwise = HTTP.post(url + "/score", json={"text_1": texts[:2], "text_2": texts[1:]}).json()
    np.testing.assert_allclose(pairwise["data"][0]["score"], want[0], atol=1e-5)
    rerank = HTTP.post(url + "/v1/rerank", json={"query": texts[0], "documents": texts[1:], "top_n": 1}).json()
    best = int(np.argmax(want))
    assert [r["index"] for r in rerank["results"]] == [best]
    assert rerank["results"][0]["document"]["text"] == texts[1 + best]
    np.testing.assert_allclose(rerank["results"][0]["relevance_score"], max(want), atol=1e-5)
    everything = HTTP.post(url + "/rerank", json={"query": texts[0], "documents": texts[1:]}).json()["results"]
    assert sorted(r["index"] for r in everything) == [0, 1]
    bad = HTTP.post(url + "/score", json={"text_1": texts, "text_2": texts[1:]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"
    assert HTTP.post(url + "/v2/rerank", json={"query": "q", "documents": []}).json()["error"]["param"] == "documents"


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/score", "/v1/rerank"])
def test_fuzzed_pooling_requests_get_answers_or_openai_errors(url, path, mode):
    """Bodies drawn from the OpenAPI document (as test_fuzz.py does for generation): no 5xx, each 4xx an
    OpenAI error object; afterwards the engine embeds and holds no KV block."""
    from schemathesis import GenerationMode

    from tests.server.test_fuzz import fuzz

    seen = fuzz(url, path, GenerationMode(mode), 25)
    assert len(seen) >= 12
    assert gauge(wait_idle(url), "kv_cache_usage_perc") == 0.0
    assert HTTP.post(url + "/v1/embeddings", json={"input": "Hello"}).status_code == 200
