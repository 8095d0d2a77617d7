"""Structured outputs on the built-in model with random sampling (temperature 1.0): every output
is valid by construction (JSON schemas checked with jsonschema, regex full-matches, choices, a
Lark grammar), alongside unconstrained requests that keep their exact tokens."""

import json
import re

import jsonschema
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from tests.fixtures_smollm2 import BUILTIN_LEVEL, QUICKSTART_SHAPE

SCHEMAS = {
    "person": {"type": "object", "required": ["name", "age"], "additionalProperties": False,
               "properties": {"name": {"type": "string", "maxLength": 12},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "nested": {"type": "object", "required": ["city", "location"], "additionalProperties": False,
               "properties": {"city": {"type": "string", "maxLength": 10},
                              "location": {"type": "object", "required": ["lat", "lon"], "additionalProperties": False,
                                           "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                          "lon": {"type": "number", "minimum": -180,
                                                                  "maximum": 180}}}}},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1,
              "maxItems": 4},
    "enum": {"type": "object", "required": ["color", "size"], "additionalProperties": False,
             "properties": {"color": {"enum": ["red", "green", "blue"]},
                            "size": {"type": "string", "enum": ["S", "M", "L"]}}},
    "flags": {"type": "object", "required": ["ok", "score", "tags"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}}},
}


@pytest.fixture(scope="module")
def llm():
    # the quickstart notebook's CPU engine (its compiled steps are shared through the run's cache),
    # compiling on demand: the variants these requests use, not every bucket
    return LLM(None, **QUICKSTART_SHAPE, compile_on_startup=False,
               optimization_level=BUILTIN_LEVEL, use_tqdm=False)


def _chat(llm, content, params):
    return llm.chat([[{"role": "user", "content": content}]], params, use_tqdm=False)[0]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_are_valid_at_temperature_1(llm, name):
    schema = SCHEMAS[name]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=schema))
    out = _chat(llm, f"Give me a JSON value ({name}).", params)
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    out = llm.generate("Code:", SamplingParams(n=6, temperature=1.0, max_tokens=20,
                                              structured_outputs=StructuredOutputsParams(regex=pattern)), use_tqdm=False)
    assert all(re.fullmatch(pattern, c.text) for c in out[0].outputs), [c.text for c in out[0].outputs]
    choices = ["yes", "no", "maybe so"]
    out = llm.generate("Answer:", SamplingParams(n=6, temperature=1.0, max_tokens=20,
                                                structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    assert all(c.text in choices for c in out[0].outputs)
    grammar = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[1-9]/\n'
    out = llm.generate("Expression:", SamplingParams(n=4, temperature=1.0, max_tokens=40,
                                                    structured_outputs=StructuredOutputsParams(grammar=grammar)),
                       use_tqdm=False)
    for c in out[0].outputs:   # a balanced expression over single digits evaluates
        assert c.finish_reason == "stop" and re.fullmatch(r"[0-9()+*]+", c.text), c.text
        eval(c.text, {})   # noqa: S307 - digits, parentheses and + * only
    # any JSON object: free-form, so a 135M model does not always close one within max_tokens; every
    # one that ends with "stop" is an object
    out = _chat(llm, "A JSON object with your name.", SamplingParams(
        n=8, temperature=1.0, max_tokens=150, seed=3, structured_outputs=StructuredOutputsParams(json_object=True)))
    closed = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert len(closed) >= 3 and all(isinstance(json.loads(text), dict) for text in closed)


def test_a_truncated_constrained_output_ends_with_length(llm):
    params = SamplingParams(temperature=1.0, max_tokens=5, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["nested"]))
    out = _chat(llm, "JSON.", params)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5


def test_unconstrained_requests_keep_their_tokens_beside_constrained_ones(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    both = llm.generate(["The capital of France is", "Say yes or no:"],
                        [greedy, SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
                            choice=["yes", "no"]))], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone and both[1].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("kwargs, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="start: missing_rule"), "structured_outputs.grammar"),
])
def test_a_bad_constraint_is_a_value_error_and_queues_nothing(llm, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_exactly_one_kind_per_request():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs has unknown field"):
        SamplingParams(structured_outputs={"pattern": "a"})
