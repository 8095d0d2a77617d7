"""vLLM's request fields beyond OpenAI's, over HTTP with the official client: allowed_token_ids, bad_words,
truncate_prompt_tokens, return_tokens_as_token_ids, return_token_ids, prompt_logprobs, priority,
stream_options.continuous_usage_stats, vllm_xargs (the server runs a custom logits processor, which claims only the
requests that pass it arguments)."""

import itertools

import numpy as np
import pytest

from tests.engine.test_logits_processors import ForceToken
from tests.server.helpers import HTTP, MODEL, openai_client, serving_tiny_engine


@pytest.fixture(scope="module")
def url():
    with serving_tiny_engine(logits_processors=[ForceToken]) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai_client(url)


def test_allowed_token_ids_bad_words_and_truncate_prompt_tokens(client, url):
    """vLLM's fields: sampling among two one-letter tokens; the free answer's first word banned; a prompt
    past max_model_len (256) cut to its last 10 tokens."""
    ids = [HTTP.post(url + "/tokenize", json={"prompt": c}).json()["tokens"] for c in "ab"]
    assert all(len(i) == 1 for i in ids)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=1.0, n=3,
                                    extra_body={"allowed_token_ids": ids[0] + ids[1], "ignore_eos": True})
    assert all(len(c.text) == 8 and set(c.text) <= {"a", "b"} for c in out.choices)
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0.0, logprobs=1)
    first = client.completions.create(**kw).choices[0].logprobs.tokens[0]
    assert first.strip()
    avoided = client.completions.create(**kw, extra_body={"bad_words": [first]}).choices[0].logprobs.tokens[0]
    assert avoided != first
    long = client.completions.create(model=MODEL, prompt=list(range(3, 300)), max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": 10})
    assert long.usage.prompt_tokens == 10 and long.usage.completion_tokens == 2
    ids = HTTP.post(url + "/tokenize", json={"prompt": "Hello world! How are you"}).json()["tokens"]
    seen = HTTP.post(url + "/detokenize", json={"tokens": ids[-2:]}).json()["prompt"]
    cut = client.completions.create(model=MODEL, prompt="Hello world! How are you", max_tokens=1, echo=True,
                                    extra_body={"truncate_prompt_tokens": 2})   # the echo: what the model saw
    assert cut.choices[0].text.startswith(seen) and not cut.choices[0].text.startswith("Hello")


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client, url):
    kw = dict(model=MODEL, max_tokens=4, temperature=0.0)
    plain = client.completions.create(prompt="Hello", logprobs=2, **kw, extra_body={"ignore_eos": True})
    named = client.completions.create(prompt="Hello", logprobs=2, **kw,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    tokens = named.choices[0].logprobs.tokens
    assert len(tokens) == 4 and all(t.startswith("token_id:") for t in tokens)
    assert all(k.startswith("token_id:") for top in named.choices[0].logprobs.top_logprobs for k in top)
    ids = [int(t.split(":")[1]) for t in tokens]   # the very tokens of the plain answer
    assert HTTP.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"] == plain.choices[0].text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], logprobs=True,
                                          top_logprobs=2, **kw, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert all(c.token.startswith("token_id:") and c.top_logprobs[0].token.startswith("token_id:") for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_return_token_ids_whole_and_streamed(client, url):
    """Each choice's generated token ids (a stream: each chunk's new ones) and the prompt's, as vLLM."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    kw = dict(model=MODEL, max_tokens=6, temperature=0.0, extra_body=extra)
    whole = client.completions.create(prompt="Hello world", **kw).choices[0]
    prompt = HTTP.post(url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert whole.prompt_token_ids == prompt and len(whole.token_ids) == 6
    assert HTTP.post(url + "/detokenize", json={"tokens": whole.token_ids}).json()["prompt"] == whole.text
    chunks = [c.choices[0] for c in client.completions.create(prompt="Hello world", stream=True, **kw) if c.choices]
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[0].prompt_token_ids == prompt and all(getattr(c, "prompt_token_ids", None) is None
                                                        for c in chunks[1:])

    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(messages=messages, **kw)
    assert chat.prompt_token_ids == HTTP.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    ids = chat.choices[0].token_ids
    assert len(ids) == 6 and HTTP.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"] == \
        chat.choices[0].message.content
    stream = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert [t for c in stream for t in (getattr(c.choices[0], "token_ids", None) or [])] == ids
    assert stream[0].prompt_token_ids == chat.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in stream[1:])


def test_prompt_logprobs_whole_responses_and_bad_values(client, url):
    kw = dict(model=MODEL, max_tokens=1, temperature=0.0)
    prompt = HTTP.post(url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    out = client.completions.create(prompt="Hello world", **kw, extra_body={"prompt_logprobs": 2}).choices[0]
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    assert all(str(t) in entry and 2 <= len(entry) <= 3 for t, entry in zip(prompt[1:], lps[1:]))
    echoed = client.completions.create(prompt="Hello world", echo=True, logprobs=2, **kw).choices[0].logprobs
    got = [entry[str(t)]["logprob"] for t, entry in zip(prompt[1:], lps[1:])]
    np.testing.assert_allclose(got, echoed.token_logprobs[1:len(prompt)], rtol=1e-5)
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(messages=messages, **kw, extra_body={"prompt_logprobs": 0})
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens and chat.prompt_logprobs[0] is None
    bad = [({"prompt": "Hi", "prompt_logprobs": 2, "stream": True}, "not available when stream is true"),
           ({"prompt": "Hi", "prompt_logprobs": 30}, "prompt_logprobs"),
           ({"prompt": "Hi", "prompt_logprobs": 1, "echo": True, "logprobs": 2}, "must equal logprobs")]
    for body, message in bad:
        error = HTTP.post(url + "/v1/completions", json=body).json()["error"]
        assert error["param"] == "prompt_logprobs" and message in error["message"], error


def test_priority_reaches_the_engine_which_schedules_fcfs(client, url):
    """vLLM's `priority`: 0 runs; any other is a 400 naming it (this server was not started with
    --scheduling-policy priority), as is a value that is not an int; the route answers on after."""
    messages = [{"role": "user", "content": "Hello"}]
    ok = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"priority": 0})
    assert ok.choices[0].finish_reason in ("length", "stop")
    for route, body in [("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": messages})]:
        for value, message in [(1, "needs scheduling_policy='priority'"), (-3, "allowed here: 0"),
                               ("high", "priority")]:
            reply = HTTP.post(url + route, json={**body, "model": MODEL, "max_tokens": 2, "priority": value})
            error = reply.json()["error"]
            assert reply.status_code == 400 and error["param"] == "priority" and message in error["message"], error
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, each chunk carries its prompt's
    tokens and its choice's completion tokens so far (logprobs count them: one entry per token); without
    include_usage it asks for nothing, as in vLLM."""
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0.0, logprobs=0, stream=True,
              extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kw, stream_options={"include_usage": True,
                                                                  "continuous_usage_stats": True}))
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in deltas]
    assert counts == list(itertools.accumulate(len(c.choices[0].logprobs.tokens) for c in deltas))
    assert counts[-1] == 6 and all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in deltas)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in deltas)
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, n=2, temperature=1.0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    finals = [c.usage.completion_tokens for c in chat[:-1] if c.choices[0].finish_reason is not None]
    assert finals == [4, 4] and chat[-1].usage.completion_tokens == 8
    plain = list(client.completions.create(**kw, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_embeddings_on_a_generating_server_say_so(url):
    reply = HTTP.post(url + "/v1/embeddings", json={"model": MODEL, "input": "Hello"})
    assert reply.status_code == 400 and "does not support Embeddings API" in reply.json()["error"]["message"]


def test_vllm_xargs_reach_the_custom_logits_processor_and_bad_ones_are_400s(client, url):
    """vLLM's vllm_xargs become SamplingParams.extra_args: the processor forces its target token (chat and
    completions, streamed too); its own check of them is a 400 naming vllm_xargs, and the server goes on."""
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=1.0,
                                    extra_body={"vllm_xargs": {"target_token": 9}, "return_token_ids": True})
    assert out.choices[0].token_ids == [9] * 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          stream=True, extra_body={"vllm_xargs": {"target_token": 9, "note": ["a", 1]},
                                                                   "return_token_ids": True})
    assert [t for chunk in chat for c in chunk.choices for t in (c.token_ids or [])] == [9] * 3
    for bad in ({"target_token": "9"}, {"target_token": -2}):
        response = HTTP.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "vllm_xargs": bad})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "vllm_xargs" and "target_token must be a token id" in error["message"]
    response = HTTP.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "vllm_xargs": [1]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "vllm_xargs", response.text
    free = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.0,
                                     extra_body={"return_token_ids": True})
    assert free.choices[0].token_ids != [9] * 4
