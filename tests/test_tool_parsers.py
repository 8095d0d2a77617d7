"""Tool-call readers: what they read out of a whole output, and that the stream of fragments they
give for any chunking of that output reassembles to the same content and calls."""

import json
import random

import pytest

from jaxpaged.tool_parsers import (TOOL_PARSERS, HermesReader, Llama3JsonReader, NamedFunctionReader,
                                   RequiredReader, get_tool_parser)

HERMES = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
CASES = [
    (HermesReader, HERMES, "Let me look. ", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    (HermesReader, "No tools needed <tool", "No tools needed <tool", []),
    (HermesReader, 'Hi <tool_call>{"name": oops}</tool_call>', 'Hi <tool_call>{"name": oops}</tool_call>', []),
    (HermesReader, 'Cut <tool_call>{"name": "f", "arguments": {"a": 1}}', "Cut ", [("f", {"a": 1})]),
    (Llama3JsonReader, '{"name": "f", "parameters": {"a": [1, 2]}}; {"name": "g", "parameters": {}}', None,
     [("f", {"a": [1, 2]}), ("g", {})]),
    (Llama3JsonReader, '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}', None, [("f", {"x": "y"})]),
    (Llama3JsonReader, "The answer is {braces}", "The answer is {braces}", []),
    (Llama3JsonReader, '{"not": "a call"}', '{"not": "a call"}', []),
    (RequiredReader, '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{"b":"}"}}]', None,
     [("f", {"a": 1}), ("g", {"b": "}"})]),
    (RequiredReader, '[{"name":"f","param', '[{"name":"f","param', []),   # truncated: content
    (lambda: NamedFunctionReader("f"), '{"a":{"b":[1,2]}}', None, [("f", {"a": {"b": [1, 2]}})]),
]


def reassemble(fragments: list[dict]) -> tuple[str, list[tuple[str, str, str]]]:
    content, calls = "", {}
    for fragment in fragments:
        content += fragment.get("content", "")
        for part in fragment.get("tool_calls", []):
            call = calls.setdefault(part["index"], ["", "", ""])
            call[0] = part.get("id", call[0])
            call[1] += part.get("function", {}).get("name", "")
            call[2] += part["function"].get("arguments", "")
    return content, [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("reader, text, content, calls", CASES)
def test_whole_and_streamed_outputs_read_the_same(reader, text, content, calls):
    assert_whole_and_streamed_read_the_same(reader, text, content, calls)


def assert_whole_and_streamed_read_the_same(reader, text: str, content: str | None, calls: list):
    """`reader()` reads `text` whole as `content` and `calls` [(name, arguments dict)], and streamed in any
    chunking into fragments that reassemble to the same."""
    whole = reader().extract(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    ids = [c.id for c in whole.tool_calls]   # the server's "call_..." ids, or (Kimi K2) the model's own
    assert all(ids) and len(set(ids)) == len(ids)
    rng = random.Random(0)
    for _ in range(5):   # any chunking of the same text
        streaming, fragments, end = reader(), [], 0
        while end < len(text):
            end = min(len(text), end + rng.randint(1, 7))
            fragments += streaming.feed(text[:end], done=False)
        fragments += streaming.feed(text, done=True)
        streamed_content, streamed_calls = reassemble(fragments)
        assert streamed_content == (content or "")
        assert [(name, args) for _, name, args in streamed_calls] == \
            [(c.name, c.arguments) for c in whole.tool_calls]
        assert streaming.called_tools == bool(calls)


def test_a_possible_call_start_is_held_back_while_streaming():
    reader = HermesReader()
    assert reader.feed("Sure <tool_", done=False) == [{"content": "Sure "}]
    assert reader.feed("Sure <tool_call>", done=False) == []


def test_the_registry_names_its_parsers():
    assert {"hermes", "llama3_json"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="hermes, kimi_k2, llama3_json"):
        get_tool_parser("mistral_v9")
