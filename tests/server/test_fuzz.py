"""Bad input fuzzed: schemathesis draws request bodies from the server's own OpenAPI document,
valid by its schemas (positive) and breaking them (negative), and sends them to a running
server; beside them, structural attacks the schemas cannot express (nesting thousands deep,
oversized or chunked bodies, NaN, duplicate keys, bytes that are not UTF-8 or not JSON). No 5xx;
every 4xx is an OpenAI error object naming the field at fault; afterwards the engine serves a
normal request and holds no KV block. Bounded: a fixed number of examples per route and mode."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app
from jaxpaged.server import openai_types as T
from jaxpaged.server.json_body import MAX_JSON_DEPTH, default_max_request_body_bytes
from jaxpaged.server.openapi import openapi_schema
from tests.server.helpers import HTTP, MODEL, gauge, metrics, serving, wait_idle
from tests.server.test_async_llm import tiny_engine_args

EXAMPLES = 60   # per route and mode: 240 requests in all
SCHEMA = schemathesis.openapi.from_dict(openapi_schema())
MAX_BODY = 64 * 1024   # the served app's bound: an oversized body stays quick to send
ROUTES = {"/v1/completions": T.CompletionRequest, "/v1/chat/completions": T.ChatCompletionRequest}
SMALLEST = {"/v1/completions": {"prompt": "Hi", "max_tokens": 1},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}}


@pytest.fixture(scope="module")
def engine():
    llm = AsyncLLM.from_engine_args(tiny_engine_args(max_num_seqs=8), use_tqdm=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with serving(build_app(engine, [MODEL], max_request_body_bytes=MAX_BODY)) as urls:
        yield urls[0]


def send(url: str, case) -> httpx.Response:
    kwargs = {"content": case.body} if isinstance(case.body, bytes) else {"json": case.body}
    return HTTP.post(url + case.path, **kwargs)


def assert_error(response: httpx.Response, status: int | None = None, param: str | None = None) -> dict:
    """Not a 5xx; a 4xx is an OpenAI error object (of `status`, naming `param`, when given)."""
    assert response.status_code < 500, response.text
    if status is not None:
        assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
    if status is not None:
        assert error["param"] == param, response.text
    return error


def assert_still_serving(url: str) -> None:
    wait_idle(url)
    answer = HTTP.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
    assert gauge(metrics(url), "kv_cache_usage_perc") == 0.0


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path", list(ROUTES))
def test_fuzzed_requests_get_answers_or_openai_errors(url, path, mode):
    seen = fuzz(url, path, mode, EXAMPLES)
    assert len(seen) >= EXAMPLES // 2
    assert_still_serving(url)


def fuzz(url: str, path: str, mode: GenerationMode, examples: int) -> list[int]:
    """POST `examples` bodies drawn for `path` from the OpenAPI document in `mode` (valid or breaking its
    schema); each answer is no 5xx, a 4xx an OpenAI error object. Returns the statuses seen."""
    seen = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=SCHEMA[path]["POST"].as_strategy(generation_mode=mode))
    def check(case):
        response = send(url, case)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert_error(response)

    check()
    print(path, mode.value, {status: seen.count(status) for status in sorted(set(seen))})
    return seen


DEEP = 3000   # brackets: past Python's recursion limit, so a parser that recurses would fail
NESTED = "[" * DEEP + "]" * DEEP
CHAT = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
# (route, body, Content-Type or None, status, param): what the schemas cannot draw
ATTACKS = [
    ("/v1/completions", f'{{"prompt": {NESTED}}}', None, 400, None),
    ("/v1/chat/completions", f'{{"messages": {NESTED}}}', None, 400, None),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ' + '{"a": ' * DEEP + "1" + "}" * DEEP +
     "}]}", None, 400, None),
    ("/tokenize", f'{{"prompt": {NESTED}}}', None, 400, None),
    ("/v1/completions", '{"prompt": "hi", "response_format": 3}', None, 400, "response_format"),
    ("/v1/completions", '{"prompt": "hi", "response_format": [{"type": "json_object"}]}', None, 400,
     "response_format"),
    ("/v1/completions", '{"prompt": "hi", "response_format": "json_object"}', None, 400, "response_format"),
    ("/v1/completions", '{"prompt": "hi", "response_format": {"type": 7}}', None, 400, "response_format"),
    ("/v1/completions", '{"prompt": "hi", "response_format": {"type": "json_schema"}}', None, 400,
     "response_format"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', None, 400, "temperature"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": Infinity}', None, 400, "max_tokens"),
    ("/v1/chat/completions", CHAT + '"logit_bias": {"5": -Infinity}}', None, 400, "logit_bias"),
    ("/v1/completions", '{"prompt": "a", "prompt": "b"}', None, 400, "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "role": "system", "content": "hi"}]}', None, 400,
     "messages"),
    ("/v1/completions", '{"prompt": "\\ud800"}', None, 400, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\udfff"}', None, 400, "model"),
    ("/v1/chat/completions", CHAT + '"stop": ["\\ud800"]}', None, 400, "stop"),
    ("/tokenize", '{"prompt": "\\ud800"}', None, 400, "prompt"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None, 400, None),
    ("/v1/completions", '{"prompt": "hi"}', "text/plain", 400, None),
    ("/v1/chat/completions", CHAT[:-2] + "}", "application/x-www-form-urlencoded", 400, None),
    ("/v1/completions", "", None, 400, None),
    ("/v1/chat/completions", "  ", None, 400, None),
    ("/v1/completions", '[{"prompt": "hi"}]', None, 400, None),
    ("/v1/completions", "7", None, 400, None),
    ("/v1/chat/completions", '"hi"', None, 400, None),
    ("/tokenize", '{"model": [1], "prompt": "hi"}', None, 400, "model"),
    ("/tokenize", '{"prompt": "hi", "add_special_tokens": "no"}', None, 400, "add_special_tokens"),
    ("/tokenize", '{"messages": {"role": "user"}}', None, 400, "messages"),
    ("/detokenize", '{"model": {}, "tokens": [1]}', None, 400, "model"),
    ("/detokenize", '{"tokens": [true, 2]}', None, 400, "tokens"),
    ("/detokenize", '{"tokens": "1 2"}', None, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, content_type, status, param", ATTACKS,
                         ids=[f"{i}-{a[0]}" for i, a in enumerate(ATTACKS)])
def test_structural_attacks_get_openai_errors_naming_the_field(url, path, body, content_type, status, param):
    raw = body if isinstance(body, bytes) else body.encode("utf-8")
    headers = {} if content_type is None else {"Content-Type": content_type}
    error = assert_error(HTTP.post(url + path, content=raw, headers=headers), status, param)
    if raw.startswith(b'{"prompt": [[[') or raw.startswith(b'{"messages": [[['):
        assert str(MAX_JSON_DEPTH) in error["message"]
    if content_type is not None:
        assert "application/json" in error["message"]


def test_the_attacks_leave_the_engine_serving(url):   # after the attacks above (a module runs in order)
    assert_still_serving(url)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                  "/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_a_body_over_the_bound_is_a_413_before_it_is_parsed(url, path):
    body = b'{"prompt": "' + b"a" * MAX_BODY + b'"}'
    whole = HTTP.post(url + path, content=body)
    assert_error(whole, 413, None)
    assert whole.json()["error"]["code"] == "request_too_large" and str(MAX_BODY) in whole.text
    chunked = HTTP.post(url + path, content=(body[i:i + 4096] for i in range(0, len(body), 4096)))
    assert "content-length" not in chunked.request.headers   # a generator is sent chunked
    assert_error(chunked, 413, None)
    fits = HTTP.post(url + path, content=b'{"prompt": "' + b"a" * (MAX_BODY - 100) + b'"}')
    assert fits.status_code != 413, fits.text


def test_by_default_the_body_bound_follows_the_engines_context(engine):
    bound = build_app(engine, [MODEL]).state.server.max_request_body_bytes
    assert bound == default_max_request_body_bytes(engine.max_model_len) == 1 << 20   # 256 tokens: the 1 MiB floor


def test_the_schema_lists_every_field_each_route_reads(url):
    """A route's schema lists its model's fields, and a field it does not list is not read:
    each other route's fields, sent to it with values of every type, change nothing."""
    schemas = openapi_schema()["components"]["schemas"]
    listed = {path: set(schemas[model.__name__]["properties"]) for path, model in ROUTES.items()}
    for path, model in ROUTES.items():
        assert listed[path] == set(model.model_fields), path
        others = set().union(*listed.values()) - listed[path]
        assert others, path
        for value in ("x", -1, 2.5, True, [[]], {"a": None}):
            body = {**SMALLEST[path], **{name: value for name in sorted(others)}}
            response = HTTP.post(url + path, json=body)
            assert response.status_code == 200, (value, response.text)
    wait_idle(url)
