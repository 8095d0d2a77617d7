"""Tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice` ask of the
engine, and how its output is read back as OpenAI tool calls.

    tool_choice   constraint on the output (llguidance)            read back by
    "none"        none (tools still go to the chat template)      nothing: plain content
    "auto"        none: the model decides                         the server's --tool-call-parser
    "required"    a JSON array of {"name", "parameters"} items    RequiredReader
    {"function"}  that function's parameters schema               NamedFunctionReader

"required" and named choices are enforced by the grammar, so any model, whatever its chat
template knows of tools, returns well-formed calls of the offered functions. "auto" needs
`--enable-auto-tool-choice --tool-call-parser NAME` (as in vLLM): the parser reads the
model's own format (Hermes' <tool_call> tags, Llama 3's JSON, Mistral's, DeepSeek's, GLM's, gpt-oss' harmony, ...).
"""

import json
from dataclasses import dataclass
from typing import Callable

from jaxpaged.tool_parsers import NamedFunctionReader, RequiredReader, ToolCallReader, get_tool_parser
from jaxpaged.server import protocol as P


@dataclass
class ToolSettings:
    """The server's: `--enable-auto-tool-choice` and `--tool-call-parser`."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)   # ValueError listing the parsers
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser NAME)")


@dataclass
class ToolPlan:
    constraint: dict | None                  # structured_outputs forcing the calls' form
    reader: Callable[[], ToolCallReader]     # one reader per choice
    # a choice that called: "tool_calls", except for a named function, where OpenAI (and vLLM) say "stop"
    finish_reason: str = "tool_calls"


def plan_tools(req: P.ParsedRequest, settings: ToolSettings) -> ToolPlan | None:
    """None when the request asks for no tool calls; APIError for a choice this server cannot honour.
    Sets `req.keep_special_tokens` where the "auto" parser reads tags that are special tokens."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        return None
    if choice is None:
        choice = "auto"   # OpenAI's default when tools are given
    if choice == "none":
        return None
    if choice == "auto":
        if not settings.enable_auto_tool_choice:
            raise P.APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                                  '--tool-call-parser NAME; or send tool_choice "required", "none" or '
                                  '{"type": "function", "function": {"name": ...}}', "tool_choice", "invalid_value")
        parser = get_tool_parser(settings.tool_call_parser)
        req.keep_special_tokens = parser.keeps_special_tokens
        return ToolPlan(None, lambda: parser(tools=tools))
    if _has_constraint(req.request):
        raise P.APIError(400, f"tool_choice {json.dumps(choice)} constrains the output itself: drop "
                              "response_format / structured_outputs", "tool_choice", "invalid_value")
    if choice == "required":
        return ToolPlan({"json": {**required_schema(tools, req.parallel_tool_calls), **COMPACT}},
                        lambda: RequiredReader(tools=tools))
    name = choice["function"]["name"]
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    return ToolPlan({"json": {**(function.get("parameters") or {"type": "object"}), **COMPACT}},
                    lambda: NamedFunctionReader(name, tools=tools), "stop")


# Forced calls are written as compact JSON (llguidance's option): arguments are read by programs,
# and free whitespace between tokens only costs steps (a small model may fill it until max_tokens).
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def _has_constraint(request) -> bool:
    """Whether the request constrains the output's form itself (structured_outputs or response_format)."""
    response_format = request.response_format
    return request.structured_outputs is not None or (response_format is not None and response_format.type != "text")


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """A JSON array of at least one call of the offered functions (exactly one unless `parallel`).

    The parameters' own definitions (`$defs`, `definitions`) move to the top, where their
    `#/$defs/...` references point once the parameters are nested (as vLLM does); two tools
    defining one name differently are a 400."""
    definitions: dict[str, dict] = {}
    calls = []
    for tool in tools:
        parameters = dict(tool["function"].get("parameters") or {"type": "object"})
        for key in ("$defs", "definitions"):
            for name, definition in (parameters.pop(key, None) or {}).items():
                known = definitions.setdefault(key, {})
                if known.get(name, definition) != definition:
                    raise P.APIError(400, f"tools define {key}/{name} differently; tool_choice \"required\" needs "
                                          "one definition per name", "tools", "invalid_value")
                known[name] = definition
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1,
              **definitions}
    if not parallel:
        schema["maxItems"] = 1
    return schema
