"""The OpenAI-compatible server, started for real with uvicorn on 127.0.0.1, driven by the
official `openai` client and by plain HTTP for what the client hides (errors, SSE, metrics)."""

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app
from jaxpaged.server import openai_types as T
from tests.server.helpers import MODEL, gauge, serving, wait_idle
from tests.server.test_async_llm import tiny_engine_args

KEY = "sk-test"


@pytest.fixture(scope="module")
def engine():
    llm = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def urls(engine):
    """Two apps on one engine: an open one and one that wants an API key."""
    with serving(build_app(engine, [MODEL, "alias"]), build_app(engine, [MODEL], api_key=KEY)) as urls:
        yield urls


@pytest.fixture(scope="module")
def client(urls):
    return openai.OpenAI(base_url=urls[0] + "/v1", api_key="unused", max_retries=0)


def test_models_version_health_tokenize(client, urls):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    assert httpx.get(urls[0] + "/health").status_code == 200
    assert httpx.get(urls[0] + "/version").json()["version"]
    tokens = httpx.post(urls[0] + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 256
    text = httpx.post(urls[0] + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    doc = httpx.get(urls[1] + "/openapi.json")   # the keyed app: the schema is public, as vLLM's
    assert doc.status_code == 200
    chat = doc.json()["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"]["$ref"].endswith("/ChatCompletionRequest")


def test_completion_stream_equals_whole_and_usage_comes_last(client):
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens + 12 == whole.usage.total_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_chat_stream_equals_whole_with_a_stop_string(client):
    kw = dict(model="alias", messages=[{"role": "user", "content": "Hello"}], temperature=0.0, max_tokens=12,
              extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**kw).choices[0].message.content
    stop = text[4:6]   # a stop string made of two characters the model is known to produce
    whole = client.chat.completions.create(**kw, stop=[stop])
    assert whole.choices[0].finish_reason == "stop" and stop not in whole.choices[0].message.content
    assert text.startswith(whole.choices[0].message.content)
    chunks = list(client.chat.completions.create(**kw, stop=[stop], stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].model == "alias"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_logprobs_and_echo(client, urls):
    out = client.completions.create(model=MODEL, prompt=["Hello world", "Hi"], n=2, max_tokens=4, logprobs=3,
                                    echo=True, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text.startswith("Hello world") and out.choices[2].text.startswith("Hi")
    lp = out.choices[0].logprobs
    prompt_len = httpx.post(urls[0] + "/tokenize", json={"prompt": "Hello world"}).json()["count"]
    assert lp.token_logprobs[0] is None and len(lp.tokens) == prompt_len + 4   # the echoed prompt, then 4
    assert lp.text_offset == sorted(lp.text_offset) and all(len(t) <= 4 for t in lp.top_logprobs[1:])
    assert out.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


BAD_COMPLETIONS = [
    (b"{not json", 400, None),
    ({"model": MODEL}, 400, "prompt"),
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "hi", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ({"prompt": [1, 100000]}, 400, "prompt"),
    ({"prompt": "", "max_tokens": 3}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 300}, 400, "max_tokens"),
    ({"prompt": list(range(3, 300))}, 400, "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ({"prompt": "hi", "cache_salt": 7}, 400, "cache_salt"),
    ({"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [3, 100000]}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": ["ok", " "]}, 400, "bad_words"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
]
BAD_CHATS = [
    ({"model": MODEL}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": ""}, 400, "cache_salt"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": 3}},
     400, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "(unclosed"}}, 400,
     "structured_outputs"),
    ({"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "bad_words": "word"}, 400, "bad_words"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {}}]}, 400,
     "tools"),
]
HI = [{"role": "user", "content": "hi"}]
# OpenAI fields this server does not implement, each asking for something: refused, never silently ignored
UNSUPPORTED = [
    ("chat/completions", {"messages": HI, "functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat/completions", {"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    ("chat/completions", {"messages": HI, "store": True}, "store"),
    ("chat/completions", {"messages": HI, "service_tier": "flex"}, "service_tier"),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ("completions", {"prompt": "hi", "suffix": " world"}, "suffix"),
]



@pytest.mark.parametrize("route, body, status, param",
                         [("completions", *case) for case in BAD_COMPLETIONS] + [("chat/completions", *case)
                                                                                for case in BAD_CHATS])
def test_bad_input_gets_its_status_and_an_error_object(urls, route, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{urls[0]}/v1/{route}", content=content)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("route, body, param", UNSUPPORTED)
def test_an_unsupported_openai_field_is_a_400_naming_it(urls, route, body, param):
    response = httpx.post(f"{urls[0]}/v1/{route}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert f"{param} is not supported by this server" in error["message"]


def test_response_format_and_structured_outputs_constrain_the_output(client):
    # a random tiny model would fill a JSON object's free whitespace until max_tokens: a value without any
    schema = {"type": "string", "enum": ["left", "right"]}
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=40, temperature=1.0, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        assert json.loads(choice.message.content) in ("left", "right")
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, temperature=1.0, n=3,
                                    extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert {c.text for c in out.choices} <= {"alpha", "beta"}
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert out.choices[0].text.isdigit() and len(out.choices[0].text) == 4


def test_response_format_constrains_completions_too(client):   # vLLM's: not OpenAI's completions field
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, temperature=1.0, n=3, seed=1,
                                    extra_body={"response_format": {"type": "json_object"}})
    closed = [json.loads(c.text) for c in out.choices if c.finish_reason == "stop"]
    assert all(c.text.startswith("{") for c in out.choices) and closed and all(isinstance(o, dict) for o in closed)
    schema = {"type": "string", "enum": ["left", "right"]}
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, temperature=1.0, n=3, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}})
    assert all(c.finish_reason == "stop" and json.loads(c.text) in ("left", "right") for c in out.choices)


def test_values_that_ask_for_nothing_are_accepted_and_unknown_fields_are_logged(client, caplog):
    caplog.set_level(logging.WARNING, logger="jaxpaged.server.protocol")
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, tools=[], tool_choice="none", parallel_tool_calls=False,
        response_format={"type": "text"}, store=False, service_tier="auto", metadata={"team": "a"}, user="u1",
        prompt_cache_key="k", safety_identifier="s1", modalities=["text"], verbosity="medium",
        extra_body={"foo_bar": 1, "functions": None, "audio": None})
    assert chat.choices[0].finish_reason
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2, best_of=2, suffix="", user="u1",
                                    extra_body={"tool_choice": "required"})   # not a completions field: ignored
    assert len(out.choices) == 2
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, best_of=1, suffix=None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("foo_bar" in w for w in warnings) and any("tool_choice" in w for w in warnings)
    assert not any("metadata" in w or "best_of" in w for w in warnings)


def test_openai_field_lists_match_the_installed_openai_package():
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat

    def keys(params) -> set:
        return set(params.__required_keys__ | params.__optional_keys__)
    assert set(T.OPENAI_CHAT_FIELDS) == keys(chat.CompletionCreateParamsNonStreaming)
    assert set(T.OPENAI_COMPLETION_FIELDS) == keys(completion.CompletionCreateParamsNonStreaming)


def test_cache_salt_keeps_prefix_cache_blocks_apart(client):
    messages = [{"role": "user", "content": "a question long enough to fill a few blocks of the prefix cache"}]

    def cached(route: str, **extra) -> int:
        if route == "chat":
            out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=extra)
        else:
            out = client.completions.create(model=MODEL, prompt=messages[0]["content"], max_tokens=1,
                                            extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens
    assert cached("chat", cache_salt="tenant-a") == 0
    assert cached("chat", cache_salt="tenant-b") == 0     # same prompt, another tenant: nothing shared
    assert cached("chat") == 0                            # no salt shares nothing with a salted prompt
    assert cached("chat", cache_salt="tenant-a") > 0      # same tenant: its own blocks again
    assert cached("chat") > 0
    assert cached("completion", cache_salt="tenant-a") == 0
    assert cached("completion", cache_salt="tenant-a") > 0


def test_api_key_guards_v1_and_model_routes_and_the_server_still_serves(urls):
    guarded = urls[1]
    assert httpx.get(guarded + "/v1/models").status_code == 401
    wrong = httpx.get(guarded + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(guarded + "/health").status_code == 200
    for route in ("/score", "/rerank", "/v2/rerank"):   # vLLM's routes that run the model, outside /v1 too
        assert httpx.post(guarded + route, json={}).status_code == 401
    keyed = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    out = keyed.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(urls[0] + "/nowhere").json()["error"]["code"] == "not_found"


def test_an_internal_failure_is_a_500_for_that_request_only(client, urls, engine, monkeypatch):
    step = engine.engine.step

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(engine.engine, "step", step)
        raise RuntimeError("injected failure")
    monkeypatch.setattr(engine.engine, "step", fail_once)
    response = httpx.post(urls[0] + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    assert response.status_code == 500 and "injected failure" in response.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].finish_reason
    assert httpx.get(urls[0] + "/health").status_code == 200


def test_a_step_failing_in_the_runner_is_a_500_and_poisons_no_prefix(urls, engine, monkeypatch):
    runner = engine.engine.runner
    prompt = list(range(3, 43))   # five full blocks of 8: the failed prefill registers four of them
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "cache_salt": "failure-test"}
    expected = httpx.post(urls[0] + "/v1/completions", json={**body, "cache_salt": "reference"}).json()
    step = runner._executables

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(runner, "_executables", step)
        raise RuntimeError("injected failure in the runner")
    monkeypatch.setattr(runner, "_executables", fail_once)
    response = httpx.post(urls[0] + "/v1/completions", json=body)
    assert response.status_code == 500 and "injected failure" in response.json()["error"]["message"]
    wait_idle(urls[0])
    again = httpx.post(urls[0] + "/v1/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # nothing kept from the failed step
    assert again["choices"][0]["text"] == expected["choices"][0]["text"]


def test_64_streams_where_a_quarter_walk_away(urls):
    """Completers finish with the text they get alone; walkers disconnect after their first chunk
    and are aborted."""
    url = urls[0]
    body = lambda i, walker: {"model": MODEL, "prompt": [3 + i, 7, 11], "temperature": 0.0,  # noqa: E731
                              "max_tokens": 240 if walker else 5, "ignore_eos": True}
    alone = {i: httpx.post(url + "/v1/completions", json=body(i, False)).json()["choices"][0]["text"]
             for i in range(64) if i % 4}
    before = wait_idle(url)

    async def client_task(http, i):
        walker = i % 4 == 0
        async with http.stream("POST", url + "/v1/completions", json={**body(i, walker), "stream": True}) as response:
            assert response.status_code == 200
            events = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if walker:
                        return None
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == alone[i]
        return chunks[-1]["choices"][0]["finish_reason"]

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(client_task(http, i) for i in range(64)))
    reasons = asyncio.run(main())
    assert [r for i, r in enumerate(reasons) if i % 4] == ["length"] * 48
    after = wait_idle(url)
    finished = gauge(after, "request_success_total") - gauge(before, "request_success_total")
    assert finished == 48   # the 16 walkers' requests were aborted, not run to 240 tokens
    ttft = f'jaxpaged:time_to_first_token_seconds_count{{model_name="{MODEL}"}}'
    assert after[ttft] - before[ttft] == 48
    tokens = f'jaxpaged:request_generation_tokens_sum{{model_name="{MODEL}"}}'
    assert after[tokens] - before[tokens] == 48 * 5


def test_a_client_that_hangs_up_on_a_whole_response_aborts_it(urls, engine, monkeypatch):
    step = engine.engine.step

    def slow_step(*args, **kwargs):   # 240 steps now take over a second, well past the client's patience
        time.sleep(0.005)
        return step(*args, **kwargs)
    before = wait_idle(urls[0])
    monkeypatch.setattr(engine.engine, "step", slow_step)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(urls[0] + "/v1/completions", timeout=0.4,
                   json={"prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "temperature": 0.0})
    after = wait_idle(urls[0], timeout=1.0)
    assert gauge(after, "request_success_total") == gauge(before, "request_success_total")


def test_serve_command_line_builds_the_engine_args(monkeypatch):
    from jaxpaged import cli, server

    calls = []
    monkeypatch.delenv("JAXPAGED_API_KEY", raising=False)
    monkeypatch.setattr(server, "run_server", lambda args, **kw: calls.append((args, kw)) or 0)
    assert cli.main(["serve", "some/model", "--port", "8123", "--api-key", "k", "--served-model-name", "a", "b",
                     "--max-model-len", "512", "--block-size", "32", "--swap-space", "1",
                     "--reasoning-parser", "qwen3"]) == 0
    args, kw = calls[0]
    assert (args.model, args.max_model_len, args.block_size, args.swap_space) == ("some/model", 512, 32, 1.0)
    assert args.served_model_name == "a" and args.compile_on_startup
    assert kw == {"host": "127.0.0.1", "port": 8123, "api_key": "k", "served_model_names": ["a", "b"],
                  "log_level": "info", "enable_auto_tool_choice": False, "tool_call_parser": None,
                  "chat_template": None, "vllm_metric_names": False, "max_num_waiting": None,
                  "shutdown_timeout": 10.0, "enable_sleep_mode": False,
                  "lora_modules": None, "max_request_body_bytes": None}
    assert args.reasoning_parser == "qwen3"
    assert cli.main(["serve", "--model", "other/model"]) == 0 and calls[1][0].model == "other/model"
    assert cli.main(["serve"]) == 0 and calls[2][0].model is None          # the built-in model
    assert cli.main(["serve", "x", "--model", "y"]) == 2                  # two different models
    assert cli.main(["serve", "--max-request-body-bytes", "4096"]) == 0
    assert calls[-1][1]["max_request_body_bytes"] == 4096
