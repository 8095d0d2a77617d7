"""The tool-call formats of Mistral, Llama 3.2 / 4 (pythonic), DeepSeek-V3 / V3.1, GLM-4.5, Qwen3-Coder,
Seed-OSS, MiniMax-M2, Granite 3, Phi-4-mini and Kimi K2: what each reads out of a whole output, the same calls
and content from any chunking of it as it streams, and the XML formats' values typed by the offered tool's
schema."""

import json

import pytest

from jaxpaged.tool_parsers import get_tool_parser
from tests.test_tool_parsers import assert_whole_and_streamed_read_the_same

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string"}}}}}]
CALL, BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_V3 = (f'Checking. {BEGIN}{CALL}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```{END}'
               f'{CALL}function{SEP}get_time\n```json\n{{}}\n```{END}<｜tool▁calls▁end｜>')
CASES = [
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', "Sure.", [("get_weather", {"city": "Paris"}),
                                                                     ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", "No [TOOL_ here", "No [TOOL_ here", []),
    ("pythonic", '[get_weather(city="Paris", days=2), get_time()]', None,
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("pythonic", '<|python_start|>[get_weather(city="a)b")]<|python_end|>', None, [("get_weather", {"city": "a)b"})]),
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "The weather is fine.", "The weather is fine.", []),
    ("deepseek_v3", DEEPSEEK_V3, "Checking. ", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("deepseek_v31", f'{BEGIN}{CALL}get_weather{SEP}{{"city": "Paris"}}{END}<｜tool▁calls▁end｜>', None,
     [("get_weather", {"city": "Paris"})]),
    ("glm45", "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>",
     "Let me check.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ("qwen3_coder", "On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "On it.\n", [("get_weather", {"city": "New York", "days": 3})]),
    ("seed_oss", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>\n<parameter=days>2"
                 "</parameter>\n</function>\n</seed:tool_call>", None, [("get_weather", {"city": "Rome", "days": 2})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                '"arguments": {}}]', None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("granite", 'Sure.<tool_call>[{"name": "get_time", "arguments": {}}]', "Sure.", [("get_time", {})]),   # 3.1+
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Rome"}}]', None,
     [("get_weather", {"city": "Rome"})]),
    ("kimi_k2", "Let me see.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
                "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", "Let me see.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("kimi_k2", "<|tool_call_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}"
                "<|tool_call_end|><|tool_call_section_end|>", None, [("get_time", {})]),   # the singular spelling
    ("llama4_pythonic", '[get_weather(city="Oslo")]', None, [("get_weather", {"city": "Oslo"})]),
    ("minimax_m2", 'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                   '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
                   '<invoke name="get_time">\n</invoke>\n'
                   "</minimax:tool_call>", "Sure.\n",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_and_streamed_outputs_read_the_same(name, text, content, calls):
    assert_whole_and_streamed_read_the_same(lambda: get_tool_parser(name)(tools=TOOLS), text, content, calls)


def test_a_parameter_whose_type_list_names_string_stays_text():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": ["string", "null"]}, "n": {"type": ["integer", "null"]}}}}}]
    text = '<minimax:tool_call><invoke name="f"><parameter name="code">123</parameter><parameter name="n">7</parameter>' \
           "</invoke></minimax:tool_call>"
    call, = get_tool_parser("minimax_m2")(tools=tools).extract(text).tool_calls
    assert json.loads(call.arguments) == {"code": "123", "n": 7}


@pytest.mark.parametrize("name, text", [
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather"><parameter name="units">42</parameter>'
                   '<parameter name="days">4</parameter><parameter name="extra">{"a": [1]}</parameter></invoke>'
                   "</minimax:tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>units</arg_key>\n<arg_value>42</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>4</arg_value>\n<arg_key>extra</arg_key>\n"
              '<arg_value>{"a": [1]}</arg_value>\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=units>\n42\n</parameter>\n<parameter=days>\n4\n"
                    '</parameter>\n<parameter=extra>\n{"a": [1]}\n</parameter>\n</function>\n</tool_call>'),
])
def test_xml_values_are_typed_by_the_tools_schema(name, text):
    """A "string" parameter stays text even when it looks like a number; others are read as JSON."""
    call, = get_tool_parser(name)(tools=TOOLS).extract(text).tool_calls
    assert json.loads(call.arguments) == {"units": "42", "days": 4, "extra": {"a": [1]}}


def test_kimi_k2_calls_keep_the_models_own_ids():
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>")
    whole = get_tool_parser("kimi_k2")(tools=TOOLS).extract(text).tool_calls
    assert [c.id for c in whole] == ["functions.get_weather:0", "functions.get_time:1"]
    streamed = get_tool_parser("kimi_k2")(tools=TOOLS)
    fragments = [f for end in range(1, len(text) + 1) for f in streamed.feed(text[:end], end == len(text))]
    ids = [f["tool_calls"][0]["id"] for f in fragments if "id" in f.get("tool_calls", [{}])[0]]
    assert ids == ["functions.get_weather:0", "functions.get_time:1"]
    assert get_tool_parser("hermes")().call_id(0).startswith("call_")


def test_special_token_formats_ask_the_server_to_keep_special_tokens():
    for name in ("mistral", "glm45", "deepseek_v3", "deepseek_v31", "pythonic", "seed_oss", "minimax_m2", "openai",
                 "granite", "kimi_k2"):
        assert get_tool_parser(name).keeps_special_tokens, name
    for name in ("hermes", "qwen3_coder", "phi4_mini_json"):   # ordinary added tokens or text
        assert not get_tool_parser(name).keeps_special_tokens, name
