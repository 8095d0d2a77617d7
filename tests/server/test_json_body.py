"""server/json_body.py without a server: bodies parsed as strict JSON, a 400 naming the top-level
field that holds the fault; nesting measured without recursion."""

import json

import pytest

from jaxpaged.server import protocol as P
from jaxpaged.server.json_body import MAX_JSON_DEPTH, default_max_request_body_bytes, json_depth, parse_json


def refused(raw: bytes) -> P.APIError:
    with pytest.raises(P.APIError) as info:
        parse_json(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    return info.value


@pytest.mark.parametrize("raw, depth", [(b"{}", 1), (b'{"a": [1, {"b": []}]}', 4), (b'{"a": "[[[{{{"}', 1),
                                        (b'{"a": "\\"[[", "b": [[]]}', 3), (b"7", 0), (b"[" * 5000, 5000)])
def test_depth_counts_brackets_outside_strings(raw, depth):
    assert json_depth(raw) == depth


def test_nesting_past_the_bound_is_refused_naming_it_and_nesting_within_is_parsed():
    deep = b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    assert str(MAX_JSON_DEPTH) in refused(deep).message
    within = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    assert parse_json(f'{{"a": {within}}}'.encode())["a"] == json.loads(within)


@pytest.mark.parametrize("raw, param, words", [
    (b'{"temperature": NaN}', "temperature", ["NaN is not a JSON number"]),
    (b'{"logit_bias": {"5": -Infinity}}', "logit_bias", ["-Infinity", "(in logit_bias)"]),
    (b'{"prompt": "a", "prompt": "b"}', "prompt", ["'prompt' is given twice"]),
    (b'{"messages": [{"role": "user", "role": "system"}]}', "messages", ["'role' is given twice", "(in messages)"]),
    (b'{"prompt": "\\ud800"}', "prompt", ["lone UTF-16 surrogate"]),
    (b'{"stop": ["x", "\\udc00\\ud800"]}', "stop", ["lone UTF-16 surrogate"]),
    (b'{"\\ud800": 1}', "\ud800", ["lone UTF-16 surrogate"]),
    (b'{"prompt": "\xff"}', None, ["not valid UTF-8"]),
    (b"", None, ["empty"]),
    (b"[1]", None, ["must be a JSON object, got list"]),
    (b'{"prompt": }', None, ["not valid JSON"]),
])
def test_what_strict_json_refuses_is_a_400_naming_the_field_that_holds_it(raw, param, words):
    error = refused(raw)
    assert error.param == param and all(w in error.message for w in words), error.message


def test_escaped_surrogate_pairs_are_characters():
    assert parse_json(b'{"prompt": "\\ud83d\\ude00 \\\\ud800"}') == {"prompt": "\U0001F600 \\ud800"}


def test_the_default_body_bound_grows_with_the_context():
    assert default_max_request_body_bytes(2048) == 1 << 20
    assert default_max_request_body_bytes(1 << 20) == 32 << 20
