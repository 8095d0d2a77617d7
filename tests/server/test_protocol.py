"""server/protocol.py without an engine: request bodies in, ParsedRequest or a 400 naming the field out;
responses through their models; the OpenAPI document."""

import dataclasses
import json
import logging

import pytest

from jaxpaged.server import openai_types as T
from jaxpaged.server import protocol as P
from jaxpaged.server import vllm_types as V
from jaxpaged.server.openapi import openapi_schema

HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def refused(parse, body: dict) -> P.APIError:
    with pytest.raises(P.APIError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens", ["an integer", "'10'"]),
    ({"prompt": "hi", "n": True}, "n", ["an integer", "True"]),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", ["a number", "'hot'"]),
    ({"prompt": "hi", "stream": "yes"}, "stream", ["a boolean"]),
    ({"prompt": "hi", "stop": 3}, "stop", ["a string or a list of strings"]),
    ({"prompt": []}, "prompt", ["a list of token ids", "[]"]),
    ({"prompt": [[]]}, "prompt", ["token-id lists"]),
    ({"prompt": None}, "prompt", ["prompt or prompt_embeds is required"]),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", ["stream is true"]),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options",
     ["include_usage must be a boolean"]),
    ({"prompt": "hi", "cache_salt": ""}, "cache_salt", ["non-empty string"]),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of", ["not supported by this server", "1 or the value of n"]),
])
def test_a_bad_completion_field_is_named_with_its_value_and_what_is_allowed(body, param, words):
    error = refused(P.parse_completion_request, body)
    assert error.param == param and all(w in error.message for w in words), error.message


@pytest.mark.parametrize("extra, param, words", [
    ({"messages": []}, "messages", ["non-empty list"]),
    ({"messages": [{"content": "no role"}]}, "messages", ["messages[0] needs role"]),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages",
     ["content[0].type must be one of 'text', 'image_url'"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", ["content[0] needs image_url"]),
    ({"messages": [{"role": "tool", "content": "18C"}]}, "messages", ["tool_call_id"]),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages",
     ["function needs arguments"]),
    ({"top_logprobs": 2}, "top_logprobs", ["needs logprobs"]),
    ({"response_format": {"type": "xml"}}, "response_format", ['"json_schema"', "'xml'"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format",
     ["json_schema needs name"]),
    ({"tools": [{"type": "function"}]}, "tools", ["tools[0] needs function"]),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", ["pattern", "'get weather'"]),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", ["'function'"]),
    ({"tool_choice": "required"}, "tool_choice", ['"required" needs tools']),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     ["'get_time'", "offered: get_weather"]),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", ['"required"', "'any'"]),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", ["a boolean"]),
    ({"metadata": {"team": 1}}, "metadata", ["metadata.team must be a string"]),
])
def test_a_bad_chat_field_is_named_with_its_value_and_what_is_allowed(extra, param, words):
    error = refused(P.parse_chat_request, {"messages": HI, **extra})
    assert error.param == param and all(w in error.message for w in words), error.message


@pytest.mark.parametrize("name, value", [("functions", [{"name": "f"}]), ("function_call", "f"), ("audio", {}),
                                         ("store", True), ("modalities", ["audio"]), ("verbosity", "high")])
def test_an_unimplemented_openai_field_is_refused_unless_it_asks_for_nothing(name, value):
    error = refused(P.parse_chat_request, {"messages": HI, name: value})
    assert error.param == name and error.code == "unsupported_parameter"
    assert error.message.startswith(f"{name} is not supported by this server")
    P.parse_chat_request({"messages": HI, name: None})   # null: the default


def test_every_openai_field_is_declared_so_only_foreign_ones_count_as_unknown():
    assert set(T.OPENAI_CHAT_FIELDS) <= set(T.ChatCompletionRequest.model_fields)
    assert set(T.OPENAI_COMPLETION_FIELDS) <= set(T.CompletionRequest.model_fields)


def test_tools_and_a_tool_history_are_parsed_into_plain_dicts():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = HI + [{"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
                     {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                      "content": [{"type": "text", "text": "18"}, {"type": "text", "text": "C"}]}]
    req = P.parse_chat_request({"messages": messages, "tools": [WEATHER], "parallel_tool_calls": False,
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert req.messages[1:] == [{"role": "assistant", "content": "", "tool_calls": [call]},
                                {"role": "tool", "content": "18\nC", "name": "get_weather", "tool_call_id": "call_1"}]
    assert req.tools == [WEATHER] and not req.parallel_tool_calls
    assert req.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    plain = P.parse_chat_request({"messages": HI, "tools": [], "tool_choice": "auto"})   # asks for nothing
    assert (plain.tools, plain.tool_choice, plain.parallel_tool_calls) == ([], "auto", True)
    tokenize = P.validate(V.TokenizeRequest, {"messages": HI, "tools": [WEATHER]})   # /tokenize's
    assert P.tool_dicts(tokenize.tools) == [WEATHER] and P.message_dicts(tokenize.messages) == HI
    assert refused(lambda body: P.validate(V.TokenizeRequest, body), {"tools": [{"type": "function"}]}).param == "tools"


def test_prompts_and_stream_usage_are_read():
    assert P.parse_completion_request({"prompt": "hi"}).prompts == ["hi"]
    assert P.parse_completion_request({"prompt": [1, 2]}).prompts == [[1, 2]]
    assert P.parse_completion_request({"prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    req = P.parse_chat_request({"messages": HI, "stream": True, "stream_options": {"include_usage": True},
                                "logprobs": True, "top_logprobs": 3, "temperature": 1})   # an int is a number
    assert req.stream and req.include_usage and req.logprobs == 3


def test_a_parsed_request_holds_the_validated_model_not_the_body_as_sent():
    assert "body" not in {f.name for f in dataclasses.fields(P.ParsedRequest)}
    assert set(P._SAMPLING_KEYS) <= set(T._Request.model_fields)   # read by getattr: declared, never extra
    req = P.parse_completion_request({"prompt": "hi", "max_completion_tokens": "x", "temperature": 1})
    assert isinstance(req.request, T.CompletionRequest) and req.request.model_extra == {"max_completion_tokens": "x"}
    assert (req.max_tokens, req.max_tokens_param) == (None, "max_tokens")   # a chat field: not read here
    params = P.build_sampling_params(req, 2, 256)
    assert params.max_tokens == P.COMPLETIONS_DEFAULT_MAX_TOKENS and params.temperature == 1.0


def test_response_format_is_validated_and_honoured_on_both_routes():
    assert refused(P.parse_completion_request, {"prompt": "hi", "response_format": 3}).param == "response_format"
    for parse, body in ((P.parse_completion_request, {"prompt": "hi"}), (P.parse_chat_request, {"messages": HI})):
        req = parse({**body, "response_format": {"type": "json_object"}})
        assert P.build_sampling_params(req, 2, 256).structured_outputs.json_object is True
        req = parse({**body, "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "n", "schema": {"type": "integer"}}}})
        assert P.build_sampling_params(req, 2, 256).structured_outputs.json == {"type": "integer"}


def test_unknown_fields_are_logged_once_and_the_other_routes_fields_are_unknown(caplog):
    caplog.set_level(logging.WARNING, logger="jaxpaged.server.protocol")
    P.parse_completion_request({"prompt": "hi", "tool_choice": "required", "foo_bar": 1, "user": "u"})
    P.parse_chat_request({"messages": HI, "metadata": {"team": "a"}, "store": False})
    warnings = [r.getMessage() for r in caplog.records if r.name == "jaxpaged.server.protocol"]
    assert len(warnings) == 1 and "foo_bar" in warnings[0] and "tool_choice" in warnings[0]


def test_responses_pass_through_their_models_keeping_the_nulls_given():
    choice = {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
              "logprobs": None, "finish_reason": None, "stop_reason": None}
    chunk = P.response("chat", "chatcmpl-1", 7, "m", [choice], chunk=True)
    assert chunk == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                     "choices": [choice]}   # no "usage" key until the last chunk
    whole = P.response("completion", "cmpl-1", 7, "m", [], P.usage(3, 2, 1))
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    with pytest.raises(RuntimeError, match="ChatCompletionChunk"):   # a server bug, not the client's 400
        P.response("chat", "chatcmpl-1", 7, "m", [{**choice, "finish_reason": "done"}], chunk=True)


def test_the_openapi_document_covers_the_routes_and_every_ref_resolves():
    doc = openapi_schema()
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "jaxpaged"
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                                 "/v1/classify", "/v1/score", "/v1/rerank", "/v1/models"}
    schemas = doc["components"]["schemas"]
    text = json.dumps(doc)
    refs = {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}
    assert refs and refs <= set(schemas) and "$defs" not in text
    chat = schemas["ChatCompletionRequest"]
    assert {"messages", "tools", "tool_choice", "response_format"} <= set(chat["properties"])
    assert chat["required"] == ["messages"]
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert ok["200"]["content"]["text/event-stream"]["schema"]["$ref"].endswith("/ChatCompletionChunk")
    assert ok["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    embeddings = doc["paths"]["/v1/embeddings"]["post"]["responses"]["200"]["content"]
    assert set(embeddings) == {"application/json"} and schemas["EmbeddingRequest"]["required"] == ["input"]
