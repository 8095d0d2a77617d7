"""Tool calling over HTTP with the official `openai` client, on a tiny random model sampling at
temperature 1.0: "required" and named choices hold by grammar, "auto" reads the Hermes format,
streams reassemble to the same calls, and the history's tool messages reach the template."""

import json

import httpx
import jsonschema
import openai
import pytest

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app
from jaxpaged.server.tools import ToolSettings
from tests.server.test_async_llm import tiny_engine_args
from tests.server.helpers import MODEL, serving
from tests.tiny_models import tiny_checkpoint

# a Hermes-style template (Qwen2.5's shape, shortened): tools in the prompt, calls in <tool_call> tags
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def engine():
    # the tool definitions make prompts of ~500 tokens
    checkpoint = tiny_checkpoint("llama", max_position_embeddings=1024)
    llm = AsyncLLM.from_engine_args(tiny_engine_args(model=checkpoint, max_model_len=1024, num_gpu_blocks_override=512),
                                    use_tqdm=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def urls(engine):
    """One app with auto tool choice (Hermes parser) and one without."""
    with serving(build_app(engine, [MODEL], tool_settings=ToolSettings(True, "hermes"), chat_template=TEMPLATE),
                 build_app(engine, [MODEL], chat_template=TEMPLATE)) as urls:
        yield urls


@pytest.fixture(scope="module")
def client(urls):
    return openai.OpenAI(base_url=urls[0] + "/v1", api_key="unused", max_retries=0)


def check_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_returns_valid_calls_of_the_offered_tools(client):
    # a random model rarely closes the array soon (each call is ~55 tokens here): those cut by
    # max_tokens say "length" and carry the calls they completed, all valid too
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1.0, n=4, max_tokens=400, seed=1)
    for choice in chat.choices:
        assert choice.finish_reason in ("tool_calls", "length")
        assert choice.message.content is None
        check_calls(choice.message.tool_calls)
    assert "tool_calls" in [choice.finish_reason for choice in chat.choices]
    ids = [call.id for choice in chat.choices for call in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_parallel_tool_calls_false_gives_one_call(client):
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=1.0, n=4, max_tokens=120)
    for choice in chat.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called(client):
    choice_ = {"type": "function", "function": {"name": "get_time"}}
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice_,
                                          temperature=1.0, n=3, max_tokens=60)
    for choice in chat.choices:
        assert choice.finish_reason == "stop"   # OpenAI's (and vLLM's) for a forced named function
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, names=("get_time",))


def _streamed(stream) -> tuple[str, dict[int, dict], str]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble_to_the_whole_answer(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0.0,
                  max_tokens=120, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kwargs))
    assert finish == whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    assert content == ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


HERMES = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'


def test_auto_reads_the_models_own_format(client):
    # the tiny model does not know Hermes' format: a regex makes it write one call after some text
    body = {"structured_outputs": {"regex": "Let me check\\. " + HERMES}}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, max_tokens=200, extra_body=body)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.strip() == "Let me check."
    check_calls(choice.message.tool_calls, names=("get_weather",))
    content, calls, finish = _streamed(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content.strip() == "Let me check." and "<tool" not in content
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Rome")


def test_auto_without_a_call_is_plain_content(client):
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto",
                                          max_tokens=5, extra_body={"structured_outputs": {"regex": "Sunny"}})
    choice = chat.choices[0]
    assert choice.message.content == "Sunny" and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_the_history_reaches_the_template(client, urls):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    ids = httpx.post(urls[0] + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(urls[0] + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '"name": "get_weather"' in prompt and '"description": "Weather"' in prompt   # the tool definitions
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "tool: 18C" in prompt
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=3)
    assert chat.choices[0].message.tool_calls is None and chat.choices[0].finish_reason == "length"


def test_truncated_call_reports_length(client):
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=3)
    assert chat.choices[0].finish_reason == "length"


def test_choices_the_server_cannot_honour_are_400s(client, urls):
    plain = openai.OpenAI(base_url=urls[1] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:   # no --enable-auto-tool-choice
        plain.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert info.value.param == "tool_choice" and "--enable-auto-tool-choice" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"})
    assert info.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.param == "tool_choice"
    # still serving
    assert plain.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=60).choices[0].message.tool_calls


@pytest.mark.parametrize("parser, asked, kept", [("glm45", None, True), ("mistral", None, True),
                                                 ("glm45", True, False), ("hermes", None, False)])
def test_auto_parsers_whose_tags_are_special_tokens_keep_them_in_the_text(parser, asked, kept):
    """GLM's, Mistral's, DeepSeek's tags are special tokens in their tokenizers: an "auto" request's text keeps
    special tokens (or the reader would never see a call) unless the request sets skip_special_tokens."""
    from jaxpaged.server import protocol as P
    from jaxpaged.server.tools import plan_tools
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS}
    if asked is not None:
        body["skip_special_tokens"] = asked
    req = P.parse_chat_request(body)
    plan_tools(req, ToolSettings(True, parser))
    assert P.build_sampling_params(req, 10, 100).skip_special_tokens is not kept
    req = P.parse_chat_request(dict(body, tool_choice="none"))
    plan_tools(req, ToolSettings(True, parser))
    assert P.build_sampling_params(req, 10, 100).skip_special_tokens is (asked is not False)


@pytest.mark.parametrize("parser, asked, skip", [("openai_gptoss", True, False), ("seed_oss", None, False),
                                                 ("seed_oss", True, True), ("qwen3", None, True)])
def test_reasoning_parsers_whose_tags_may_be_special_tokens_keep_them_in_a_chat_answer(parser, asked, skip):
    """harmony's markers are special tokens: kept whatever the request says; Seed-OSS' tags may be: kept
    unless the request sets skip_special_tokens; <think> is text."""
    from jaxpaged.server import protocol as P
    body = {"model": MODEL, "messages": ASK} if asked is None else {"model": MODEL, "messages": ASK,
                                                                    "skip_special_tokens": asked}
    req = P.parse_chat_request(body)
    P.plan_reasoning(req, parser)
    assert P.build_sampling_params(req, 10, 100).skip_special_tokens is skip
    completion = P.parse_completion_request({"model": MODEL, "prompt": "Hi"})
    P.plan_reasoning(completion, parser)   # a completion's text is the model's, as asked
    assert P.build_sampling_params(completion, 10, 100).skip_special_tokens


def test_server_settings_are_checked():
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolSettings(True, None)
    with pytest.raises(ValueError, match="hermes"):
        ToolSettings(False, "nope")


def _streamed_choices(stream) -> dict[int, tuple[str, list[tuple[str, str]], str]]:
    """Per choice index: (content, [(name, arguments)], finish_reason) reassembled from a stream."""
    parts: dict[int, dict] = {}
    for chunk in stream:
        for choice in chunk.choices:
            got = parts.setdefault(choice.index, {"content": "", "calls": {}, "finish": None})
            got["content"] += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = got["calls"].setdefault(part.index, ["", ""])
                if part.function is not None:
                    call[0] += part.function.name or ""
                    call[1] += part.function.arguments or ""
            got["finish"] = choice.finish_reason or got["finish"]
    return {i: (g["content"], [tuple(c) for _, c in sorted(g["calls"].items())], g["finish"])
            for i, g in parts.items()}


def test_each_streamed_choice_reassembles_and_parallel_false_keeps_the_first_call(client):
    body = {"structured_outputs": {"regex": "Let me check\\. " + HERMES + HERMES}}   # two calls, any model
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=7, n=2, max_tokens=300,
                  extra_body=body)
    for parallel, calls in ((True, 2), (False, 1)):
        whole = client.chat.completions.create(parallel_tool_calls=parallel, **kwargs)
        streamed = _streamed_choices(client.chat.completions.create(stream=True, parallel_tool_calls=parallel,
                                                                    **kwargs))
        assert sorted(streamed) == [0, 1]
        for choice in whole.choices:
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == calls
            check_calls(choice.message.tool_calls, names=("get_weather",))
            content, streamed_calls, finish = streamed[choice.index]
            assert finish == "tool_calls" and content.strip() == choice.message.content.strip() == "Let me check."
            assert streamed_calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_tool_schema_with_defs_is_required_and_a_bad_one_is_a_400_naming_tools(client):
    city = {"type": "string", "enum": ["Paris", "Rome"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
        "additionalProperties": False, "$defs": {"City": city}}}}
    chat = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False, temperature=1.0, max_tokens=120)
    call = chat.choices[0].message.tool_calls[0]
    assert chat.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments)["city"] in city["enum"]
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[broken], tool_choice="required")
    assert info.value.param == "tools"
