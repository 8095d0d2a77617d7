"""Tool calls read out of a model's text: whole (`extract`) or as it streams (`feed`).

A reader's `parse(text, done)` says what the text holds so far: the content that is surely
content (text that could still begin a call is held back) and the calls known so far, each
`(name, arguments)` with `arguments` a JSON string that only ever grows. Everything else,
OpenAI's message and stream-delta shapes, derives from that one method, so a streamed
answer always reassembles to the whole one.

    reader        the model writes                                       chosen by
    hermes        text <tool_call>{"name", "arguments"}</tool_call> ...  --tool-call-parser hermes
    llama3_json   {"name", "parameters"}; {"name", "parameters"}         --tool-call-parser llama3_json
    required      [{"name", "parameters"}, ...] (forced by grammar)      tool_choice "required"
    named         the arguments object itself (forced by grammar)        tool_choice {"function": ...}

Mistral's, the pythonic one (Llama 3.2 / 4), DeepSeek-V3's and V3.1's, GLM-4.5's and Qwen3-Coder's are in
`jaxpaged.tool_formats`; gpt-oss' (`openai`, harmony's channels) in `jaxpaged.harmony`. More formats:
subclass ToolCallReader and decorate with `@register_tool_parser("name")`.
"""

import abc
import importlib
import json
import logging
import uuid
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

TOOL_PARSERS: dict[str, type["ToolCallReader"]] = {}


def register_tool_parser(name: str):
    def register(cls):
        TOOL_PARSERS[name] = cls
        return cls
    return register


def get_tool_parser(name: str) -> type["ToolCallReader"]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}")
    return TOOL_PARSERS[name]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str   # a JSON object as text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None          # None when the whole output was calls
    tool_calls: list[ToolCall]


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolCallReader(abc.ABC):
    """One choice's reader; `feed` keeps what it has sent, so use a new reader per choice."""
    # the format's tags are special tokens in its models' tokenizers: an "auto" tool-choice request's text
    # keeps special tokens unless the request says otherwise (as vLLM's parsers' adjust_request)
    keeps_special_tokens = False
    # the reader takes the whole output, reasoning included, and says what of it is content (harmony's); else
    # it reads what a reasoning parser left as the answer, and an output without calls is all content
    reads_whole_output = False

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self.called_tools = False   # did the output hold at least one call
        self._sent_chars = 0
        self._sent_calls: list[tuple[str, int]] = []   # (id, characters of arguments sent) per call

    @abc.abstractmethod
    def parse(self, text: str, done: bool) -> tuple[str, list[tuple[str, str]]]:
        """(content surely so far, [(name, arguments so far)]); changes nothing. Each format's own."""

    def _read(self, text: str, done: bool) -> tuple[str, list[tuple[str, str]]]:
        content, calls = self.parse(text, done)
        if done and not calls and not self.reads_whole_output:   # nothing was called: all of it is content
            content = text
        self.called_tools = self.called_tools or bool(calls)
        return content, calls

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole output read at once."""
        content, calls = self._read(text, done=True)
        if not calls:
            return ExtractedToolCalls(content, [])
        return ExtractedToolCalls(content or None, [ToolCall(name, arguments, self.call_id(index))
                                                    for index, (name, arguments) in enumerate(calls)])

    def call_id(self, index: int) -> str:
        """The id of the output's call `index` (a new one of the server's; a format may keep the model's)."""
        return new_call_id()

    def feed(self, text: str, done: bool) -> list[dict]:
        """The new stream-delta fragments of the output so far (`text` is cumulative): {"content": ...}
        or {"tool_calls": [one OpenAI call delta]}; changes what the reader has sent."""
        content, calls = self._read(text, done)
        fragments = []
        if len(content) > self._sent_chars:
            fragments.append({"content": content[self._sent_chars:]})
            self._sent_chars = len(content)
        for index, (name, arguments) in enumerate(calls):
            if index == len(self._sent_calls):
                self._sent_calls.append((self.call_id(index), len(arguments)))
                call = {"index": index, "id": self._sent_calls[index][0], "type": "function",
                        "function": {"name": name, "arguments": arguments}}
            else:
                call_id, sent = self._sent_calls[index]
                if len(arguments) <= sent:
                    continue
                self._sent_calls[index] = (call_id, len(arguments))
                call = {"index": index, "function": {"arguments": arguments[sent:]}}
            fragments.append({"tool_calls": [call]})
        return fragments


def _held_back(text: str, marker: str) -> int:
    """Length of the end of `text` that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _call(obj, argument_keys=("arguments", "parameters")) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    return obj["name"], _arguments(arguments)


@register_tool_parser("hermes")
class HermesReader(ToolCallReader):
    """Hermes' format (Qwen2.5, Qwen3, NousResearch Hermes): content, then one or more
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The content is the text before the
    first call; a call that is not valid JSON is dropped (and logged)."""
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text, done):
        first = text.find(self.start)
        if first < 0:
            return text[:len(text) - (0 if done else _held_back(text, self.start))], []
        calls, pos = [], first
        while pos >= 0:
            body_start = pos + len(self.start)
            close = text.find(self.end, body_start)
            if close < 0 and not done:
                break
            body = text[body_start:close if close >= 0 else len(text)]
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
            elif close >= 0 or body.strip():
                logger.warning("dropping a tool call that is not {\"name\", \"arguments\"} JSON: %r", body[:200])
            if close < 0:
                break
            pos = text.find(self.start, close + len(self.end))
        return text[:first], calls


@register_tool_parser("llama3_json")
class Llama3JsonReader(ToolCallReader):
    """Llama 3.1+'s JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (several joined
    by `;`), maybe after `<|python_tag|>`; an output starting otherwise is content."""
    tag = "<|python_tag|>"

    def parse(self, text, done):
        body = text.lstrip()
        tagged = body.startswith(self.tag)
        if tagged:
            body = body[len(self.tag):].lstrip()
        if not body or (self.tag.startswith(body) and not done):
            return "", []
        if not tagged and not body.startswith("{"):
            return text, []
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                break
            call = _call(obj)
            if call is None:
                break
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        return "", calls


class RequiredReader(ToolCallReader):
    """tool_choice "required": the grammar makes the output a JSON array of {"name", "parameters"}."""

    def parse(self, text, done):
        body = text.lstrip()
        if not body.startswith("["):
            return "", []
        calls, pos, decoder = [], 1, json.JSONDecoder()
        while True:
            while pos < len(body) and body[pos] in " \t\n,":
                pos += 1
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:   # the next item is not complete yet (or the array ended)
                return "", calls
            call = _call(obj, ("parameters",))
            if call is None:
                return "", calls
            calls.append(call)


class NamedFunctionReader(ToolCallReader):
    """tool_choice {"type": "function", "function": {"name": N}}: the grammar makes the whole output
    N's arguments object, streamed as it grows."""

    def __init__(self, name: str, tools: list[dict] | None = None):
        super().__init__(tools)
        self.name = name

    def parse(self, text, done):
        return "", [(self.name, text)] if text else []


for _module in ("jaxpaged.tool_formats", "jaxpaged.harmony"):   # register the formats they define (they import this)
    importlib.import_module(_module)
