"""OpenAI's Responses API (/v1/responses) with the official client: a response is the chat completion
its input amounts to (the same greedy text and token counts), streamed as typed events that reassemble
to it; reasoning, function calls and structured text come back as output items; previous_response_id
continues a stored conversation and GET returns it; bad bodies are 400s naming the field."""

import json

import openai
import pytest

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app
from jaxpaged.server.tools import ToolSettings
from tests.server.helpers import HTTP, MODEL, serving
from tests.server.test_async_llm import tiny_engine_args
from tests.server.test_reasoning_server import TEMPLATE, thinker, thinking
from tests.server.test_tool_calls import TOOLS

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]   # the Responses API's flat tools
PLAIN = {"chat_template_kwargs": {"enable_thinking": False}}   # the template closes the thinking: all is answer


@pytest.fixture(scope="module")
def url():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(model=thinker(), max_model_len=512,
                                                        num_gpu_blocks_override=256, reasoning_parser="qwen3"),
                                       use_tqdm=False)
    app = build_app(engine, [MODEL], tool_settings=ToolSettings(True, "hermes"), chat_template=TEMPLATE)
    with serving(app) as urls:
        yield urls[0]
    engine.shutdown()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def chat(url: str, **body) -> dict:
    reply = HTTP.post(url + "/v1/chat/completions", json={"temperature": 0.0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_response_is_the_chat_completion_of_its_input_whole_and_streamed(client, url):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    want = chat(url, messages=messages, max_completion_tokens=12, **PLAIN)
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello there",
                                       max_output_tokens=12, temperature=0.0, extra_body=PLAIN)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.output_text == want["choices"][0]["message"]["content"]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == want["usage"]["completion_tokens"] == 12
    assert response.instructions == "Be brief." and response.max_output_tokens == 12
    events = list(client.responses.create(model=MODEL, instructions="Be brief.", input="Hello there",
                                          max_output_tokens=12, temperature=0.0, stream=True, extra_body=PLAIN))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_reasoning_and_a_constrained_answer_come_back_as_items(client, url):
    extra = {**thinking(url), "structured_outputs": {"regex": r"[A-Z][a-z]{2,6}\."}}
    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=60, extra_body=extra)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and set(reasoning.content[0].text) == {"a"}
    assert message.type == "message" and response.output_text.endswith(".") and response.status == "completed"
    tokens = len(reasoning.content[0].text) + 1   # each "a" a token, then </think>
    assert response.usage.output_tokens_details.reasoning_tokens == tokens
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=60, extra_body=extra,
                                          stream=True))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == reasoning.content[0].text and events[-1].response.output_text == response.output_text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    form = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
    structured = client.responses.create(model=MODEL, input="A number?", max_output_tokens=60, text=form,
                                         extra_body=thinking(url))
    assert isinstance(json.loads(structured.output_text)["n"], int)   # after the reasoning, as the schema says


def test_function_calls_continue_with_previous_response_id_and_are_stored(client, url):
    ask = dict(model=MODEL, input="Time?", tools=FUNCTIONS, tool_choice="required", max_output_tokens=200,
               temperature=0.0, extra_body=PLAIN)
    first = client.responses.create(**ask)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name in ("get_weather", "get_time") and calls[0].call_id
    json.loads(calls[0].arguments)
    events = list(client.responses.create(**ask, stream=True))   # the same call, streamed
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name) for i in added] == [("function_call", c.name) for c in calls]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        "".join(c.arguments for c in calls)
    assert [i.type for i in events[-1].response.output] == [i.type for i in first.output]
    assert HTTP.get(f"{url}/v1/responses/{first.id}").json() == first.model_dump(mode="json", exclude_unset=True)
    answer = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00 UTC"}]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=answer, max_output_tokens=3,
                                     temperature=0.0, extra_body=PLAIN)
    history = [{"role": "user", "content": "Time?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": calls[0].call_id, "type": "function",
                    "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
               {"role": "tool", "tool_call_id": calls[0].call_id, "content": "12:00 UTC"}]
    want = chat(url, messages=history, max_completion_tokens=3, **PLAIN)
    assert second.usage.input_tokens == want["usage"]["prompt_tokens"] and second.previous_response_id == first.id
    assert second.output_text == want["choices"][0]["message"]["content"]
    assert client.responses.delete(first.id) is None   # (the client returns nothing) forgotten:
    assert HTTP.get(f"{url}/v1/responses/{first.id}").status_code == 404
    assert HTTP.post(url + "/v1/responses", json={"input": "hi", "previous_response_id": first.id}).status_code == 404


@pytest.mark.parametrize("body, status, param", [
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}}, 400, "text"),
    ({"input": "hi", "tool_choice": "auto", "tools": FUNCTIONS[:1], "model": "other"}, 404, "model"),
])
def test_bad_bodies_are_errors_naming_the_field(url, body, status, param):
    reply = HTTP.post(url + "/v1/responses", json=body)
    assert reply.status_code == status and reply.json()["error"]["param"] == param, reply.text
    assert HTTP.get(url + "/v1/responses/resp_nope").status_code == 404


def test_the_request_fields_match_the_installed_openai_package():
    from openai.types.responses import response_create_params

    from jaxpaged.server.responses_types import OPENAI_RESPONSES_FIELDS, ResponsesRequest

    params = response_create_params.ResponseCreateParamsNonStreaming
    assert set(OPENAI_RESPONSES_FIELDS) == (params.__required_keys__ | params.__optional_keys__) - {"stream"}
    assert set(OPENAI_RESPONSES_FIELDS) <= set(ResponsesRequest.model_fields)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_responses_requests_get_answers_or_openai_errors(url, mode):
    from schemathesis import GenerationMode

    from tests.server.helpers import gauge, wait_idle
    from tests.server.test_fuzz import fuzz

    seen = fuzz(url, "/v1/responses", GenerationMode(mode), 25)
    assert len(seen) >= 12
    assert gauge(wait_idle(url), "kv_cache_usage_perc") == 0.0
    assert HTTP.post(url + "/v1/responses", json={"input": "Hello", "max_output_tokens": 2}).status_code == 200
