"""More models' tool-call formats (registered with jaxpaged.tool_parsers under vLLM's names).

    reader         the model writes
    mistral        [TOOL_CALLS][{"name", "arguments"}, ...]   or (v11+ tokenizers) [TOOL_CALLS]name[ARGS]{...} ...
    pythonic       [get_weather(city="Paris"), get_time()]    (Llama 3.2, Llama 4; <|python_start|> optional;
                                                               also llama4_pythonic)
    deepseek_v3    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{...}\\n```
                   <｜tool▁call▁end｜>...
    deepseek_v31   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
    glm45          <tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>
    qwen3_coder    <tool_call>\\n<function=name>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>
    seed_oss       qwen3_coder's between <seed:tool_call> and </seed:tool_call> (qwen3_xml: qwen3_coder's name too)
    granite        <|tool_call|>[{"name", "arguments"}, ...]   (Granite 3)
    phi4_mini_json functools[{"name", "arguments"}, ...]      (Phi-4-mini)
    kimi_k2        <|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}
                   <|tool_call_end|>...
    minimax_m2     <minimax:tool_call>\\n<invoke name="f">\\n<parameter name="k">v</parameter>\\n</invoke>\\n...

The content is the text before the first call. A call is reported once it is whole (its closing tag, or
the end of the output), with its arguments as one JSON object; the XML formats' values are typed by the
offered tool's parameter schema (a "string" stays text; anything else is read as JSON where it parses).
Tags that are special tokens in the model's tokenizer ([TOOL_CALLS], GLM's, DeepSeek's, Llama 4's) reach the
reader because the server keeps special tokens in the text of "auto" tool-choice requests
(`ToolCallReader.keeps_special_tokens`), as vLLM's parsers ask; the EOS or stop token that ends an answer is
left out of its text all the same (jaxpaged.engine.output_processor).
"""

import abc
import ast
import json
import logging
import re

from jaxpaged.tool_parsers import ToolCallReader, _arguments, _call, _held_back, register_tool_parser

logger = logging.getLogger(__name__)


class _TaggedReader(ToolCallReader):
    """A format whose calls follow a start marker: the content before it, then `calls(body, done)`."""
    start = ""
    also: tuple[str, ...] = ()   # other spellings of the start marker that some of the format's models write
    keeps_special_tokens = True

    def parse(self, text, done):
        for other in self.also:
            text = text.replace(other, self.start)
        first = text.find(self.start)
        if first < 0:
            keep = 0 if done else max(_held_back(text, marker) for marker in (self.start, *self.also))
            return text[:len(text) - keep], []
        return text[:first], self.calls(text[first + len(self.start):], done)

    @abc.abstractmethod
    def calls(self, body: str, done: bool) -> list[tuple[str, str]]:
        """[(name, arguments JSON)] of the calls whole so far in `body` (the text after `start`)."""

    def blocks(self, body: str, done: bool):
        """Each call's text between `start` and `end` (an XML format's), in turn: the closed ones, and at the
        end of the output an unclosed last one."""
        for block in (self.start + body).split(self.start)[1:]:
            inner, closed, _ = block.partition(self.end)
            if not closed and not done:
                return
            yield inner

    def schema_type(self, function: str, parameter: str) -> str | list | None:
        """The offered tool's JSON-schema type of `parameter`: a name or a list of names (None if not given)."""
        for tool in self.tools:
            spec = tool.get("function", tool)
            if spec.get("name") == function:
                prop = ((spec.get("parameters") or {}).get("properties") or {}).get(parameter) or {}
                kind = prop.get("type")
                return kind if isinstance(kind, (str, list)) else None
        return None

    def typed(self, function: str, parameter: str, value: str):
        """An XML format's value as its schema says: text for a string (or a type list naming "string"), else
        JSON (or a Python literal)."""
        kind = self.schema_type(function, parameter)
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return value
        for read in (json.loads, ast.literal_eval):
            try:
                return read(value)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
        return value


def _json_values(body: str):
    """Each complete JSON value in `body` in turn, with the text after it."""
    decoder, pos = json.JSONDecoder(), 0
    while True:
        while pos < len(body) and body[pos] in " \t\n,;":
            pos += 1
        try:
            value, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return
        yield value, body[pos:]


@register_tool_parser("mistral")
class MistralReader(_TaggedReader):
    """Mistral's: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (v3 tokenizers), or
    `name[ARGS]{...}` once per call (v11+ tokenizers, each call after its own [TOOL_CALLS])."""
    start, args = "[TOOL_CALLS]", "[ARGS]"

    def calls(self, body, done):
        calls = []
        for part in body.split(self.start):
            name, sep, arguments = part.partition(self.args)
            if sep:   # v11: name[ARGS]{...}
                found = next(_json_values(arguments), None)
                if found is not None:
                    calls.append((name.strip(), _arguments(found[0])))
                continue
            calls += _json_calls(part)
        return calls


def _json_calls(body: str) -> list[tuple[str, str]]:
    """The whole {"name", "arguments"} objects of a JSON array (or objects in turn) that `body` begins."""
    array = body.lstrip()
    if array.startswith("["):
        array = array[1:]
    calls = []
    for value, _ in _json_values(array):
        items = value if isinstance(value, list) else [value]
        calls += [c for c in map(_call, items) if c is not None]
    return calls


@register_tool_parser("granite")
class GraniteReader(_TaggedReader):
    """Granite 3's: `<|tool_call|>` (3.0; `<tool_call>` as text from 3.1 on) then a JSON array of {"name",
    "arguments"}."""
    start, also = "<|tool_call|>", ("<tool_call>",)

    def calls(self, body, done):
        return _json_calls(body)


@register_tool_parser("phi4_mini_json")
class Phi4MiniReader(GraniteReader):
    """Phi-4-mini's: `functools[{"name", "arguments"}, ...]`."""
    start, also = "functools", ()
    keeps_special_tokens = False


@register_tool_parser("kimi_k2")
class KimiK2Reader(_TaggedReader):
    """Kimi K2's: `<|tool_calls_section_begin|>`, then each call `<|tool_call_begin|>functions.NAME:INDEX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>`. The call's id is the model's own `functions.NAME:INDEX`
    (as vLLM keeps it: Kimi's template writes it back with the call's result)."""
    start, also = "<|tool_calls_section_begin|>", ("<|tool_call_section_begin|>",)   # (some checkpoints write it)
    call = re.compile(r"<\|tool_call_begin\|>\s*([^<]*?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                      re.DOTALL)

    def __init__(self, tools=None):
        super().__init__(tools)
        self._ids: list[str] = []

    def calls(self, body, done):
        found = self.call.findall(body)
        self._ids = [ident for ident, _ in found]
        return [(ident.rsplit(":", 1)[0].removeprefix("functions."), _compact(arguments.strip()))
                for ident, arguments in found]

    def call_id(self, index):
        return self._ids[index] if index < len(self._ids) and self._ids[index] else super().call_id(index)


@register_tool_parser("llama4_pythonic")
@register_tool_parser("pythonic")
class PythonicReader(ToolCallReader):
    """A Python list of calls with literal arguments: `[f(a=1, b="x"), g()]` (maybe between Llama 4's
    <|python_start|> and <|python_end|>). An output that does not start with "[" is content; a call
    shows once its ")" has come."""
    tags = ("<|python_start|>", "<|python_end|>")
    keeps_special_tokens = True

    def parse(self, text, done):
        body = text.strip()
        if body.startswith(self.tags[0]):
            body = body[len(self.tags[0]):].strip()
        body = body.removesuffix(self.tags[1]).rstrip()
        if not body or (self.tags[0].startswith(body) and not done):
            return "", []
        if not body.startswith("["):
            return text, []
        for end in sorted((i for i, c in enumerate(body) if c in ")]"), reverse=True):
            calls = _python_calls(body[:end + 1] + ("" if body[end] == "]" else "]"))
            if calls is not None:
                return "", calls
        return ("", []) if not done else (text, [])


def _python_calls(source: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of a list of calls with literal keyword arguments, or None."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                                                  and not c.args for c in tree.elts):
        return None
    try:
        return [(c.func.id, json.dumps({k.arg: ast.literal_eval(k.value) for k in c.keywords}, ensure_ascii=False))
                for c in tree.elts]
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


@register_tool_parser("deepseek_v3")
class DeepSeekV3Reader(_TaggedReader):
    """DeepSeek-V3 and R1's: each call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` and its arguments
    in a ```json block, then `<｜tool▁call▁end｜>`."""
    start = "<｜tool▁calls▁begin｜>"
    call = re.compile(r"<｜tool▁call▁begin｜>(?:[^<]*?)<｜tool▁sep｜>([^\n]*)\n```json\n(.*?)\n```<｜tool▁call▁end｜>",
                      re.DOTALL)

    def calls(self, body, done):
        return [(name.strip(), _compact(arguments)) for name, arguments in self.call.findall(body)]


@register_tool_parser("deepseek_v31")
class DeepSeekV31Reader(DeepSeekV3Reader):
    """DeepSeek-V3.1's: `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""
    call = re.compile(r"<｜tool▁call▁begin｜>([^<]*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)


def _compact(arguments: str) -> str:
    """A call's arguments as JSON text: re-serialized where they parse, as written where they do not."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        logger.warning("a tool call's arguments are not JSON: %r", arguments[:200])
        return arguments


@register_tool_parser("glm45")
class Glm45Reader(_TaggedReader):
    """GLM-4.5 / 4.6 / 4.7's: `<tool_call>name` then `<arg_key>k</arg_key><arg_value>v</arg_value>` pairs,
    then `</tool_call>`; several calls one after another."""
    start, end = "<tool_call>", "</tool_call>"
    pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def calls(self, body, done):
        calls = []
        for inner in self.blocks(body, done):
            name = inner.split("<arg_key>", 1)[0].strip()
            if name:
                calls.append((name, json.dumps({k.strip(): self.typed(name, k.strip(), v)
                                                for k, v in self.pair.findall(inner)}, ensure_ascii=False)))
        return calls


@register_tool_parser("qwen3_xml")
@register_tool_parser("qwen3_coder")
class Qwen3CoderReader(_TaggedReader):
    """Qwen3-Coder's XML: `<tool_call><function=name><parameter=k>v</parameter>...</function></tool_call>`
    (one newline around each value is the format's, not the value's)."""
    start, end = "<tool_call>", "</tool_call>"
    keeps_special_tokens = False   # Qwen's <tool_call> is an ordinary added token
    function = re.compile(r"<function=([^>]*)>(.*?)(?:</function>|$)", re.DOTALL)
    parameter = re.compile(r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def calls(self, body, done):
        calls = []
        for inner in self.blocks(body, done):
            for name, params in self.function.findall(inner):
                name = name.strip()
                arguments = {k.strip(): self.typed(name, k.strip(), _strip_newline(v))
                             for k, v in self.parameter.findall(params)}
                calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return calls


@register_tool_parser("seed_oss")
class SeedOssReader(Qwen3CoderReader):
    """Seed-OSS's: Qwen3-Coder's XML between `<seed:tool_call>` and `</seed:tool_call>`."""
    start, end = "<seed:tool_call>", "</seed:tool_call>"
    keeps_special_tokens = True


@register_tool_parser("minimax_m2")
class MiniMaxM2Reader(Qwen3CoderReader):
    """MiniMax-M2's: `<minimax:tool_call>` then `<invoke name="f"><parameter name="k">v</parameter></invoke>`
    per call, then `</minimax:tool_call>` (Qwen3-Coder's reading, its own tags)."""
    start, end = "<minimax:tool_call>", "</minimax:tool_call>"
    keeps_special_tokens = True
    function = re.compile(r'<invoke name="([^"]*)">(.*?)(?:</invoke>|$)', re.DOTALL)
    parameter = re.compile(r'<parameter name="([^"]*)">(.*?)(?:</parameter>|(?=<parameter )|$)', re.DOTALL)


def _strip_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value
