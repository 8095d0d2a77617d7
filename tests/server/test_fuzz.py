"""Bad input fuzzed: schemathesis draws request bodies from the server's own OpenAPI document,
valid by its schemas (positive) and breaking them (negative), and sends them to a running
server. No 5xx; every 4xx is an OpenAI error object; afterwards the engine serves a normal
request and holds no KV block. Bounded: a fixed number of examples per route and mode."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from jaxpaged import AsyncLLM
from server import build_app
from server.openapi import openapi_schema
from tests.server.helpers import HTTP, MODEL, gauge, metrics, serving, wait_idle
from tests.server.test_async_llm import tiny_engine_args

EXAMPLES = 60   # per route and mode: 240 requests in all
SCHEMA = schemathesis.openapi.from_dict(openapi_schema())


@pytest.fixture(scope="module")
def url():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(max_num_seqs=8), use_tqdm=False)
    with serving(build_app(engine, [MODEL])) as urls:
        yield urls[0]
    engine.shutdown()


def send(url: str, case) -> httpx.Response:
    kwargs = {"content": case.body} if isinstance(case.body, bytes) else {"json": case.body}
    return HTTP.post(url + case.path, **kwargs)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_requests_get_answers_or_openai_errors(url, path, mode):
    seen = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=SCHEMA[path]["POST"].as_strategy(generation_mode=mode))
    def check(case):
        response = send(url, case)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text

    check()
    print(path, mode.value, {status: seen.count(status) for status in sorted(set(seen))})
    assert len(seen) >= EXAMPLES // 2
    wait_idle(url)
    answer = HTTP.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
    assert gauge(metrics(url), "kv_cache_usage_perc") == 0.0
