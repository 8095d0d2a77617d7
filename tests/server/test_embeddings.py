"""/v1/embeddings on a server with --runner pooling, with the official client (which asks base64): each
input's embedding is transformers' last hidden state, normalized; bad bodies are 400s naming the field,
and the generation routes say this model does not generate."""

import numpy as np
import pytest

from tests.engine.test_embed import hf_last_hidden, unit
from tests.server.helpers import HTTP, MODEL, openai_client, serving_tiny_engine


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
