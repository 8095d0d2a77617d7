"""Structured outputs "valid by construction" over HTTP on the built-in model (real weights) at temperature 1.0,
with the official client: response_format JSON schemas, tool_choice "required" (parallel calls
allowed) and a named function; every output valid, every choice closed."""

import json

import jsonschema
import openai
import pytest

from jaxpaged import AsyncLLM
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.server import build_app
from tests.fixtures_smollm2 import BUILTIN_LEVEL, QUICKSTART_SHAPE
from tests.server.helpers import serving
from tests.server.test_tool_calls import SCHEMAS, TOOLS

PERSON = {"type": "object", "required": ["name", "age", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Call the tool."}]


@pytest.fixture(scope="module")
def client():
    engine = AsyncLLM.from_engine_args(EngineArgs(model=None, **QUICKSTART_SHAPE, compile_on_startup=False,
                                                  optimization_level=BUILTIN_LEVEL),
                                       use_tqdm=False)
    with serving(build_app(engine, ["smollm2"])) as (url,):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    engine.shutdown()


def test_json_schema_and_forced_tool_calls_are_all_valid(client):
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe a person as JSON."}], temperature=1.0,
        n=4, max_tokens=120, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    for tool_choice, finish in (("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}},
                                                             "stop")):
        chat = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                              temperature=1.0, n=4, max_tokens=200)
        for choice in chat.choices:
            assert choice.finish_reason == finish and choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
