"""OpenAI's harmony format (gpt-oss): an answer written as messages, each on a channel.

    <|channel|>analysis<|message|>The user asks for the weather...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ...}<|call|>
    ... or
    <|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>

The output goes on from the prompt's `<|start|>assistant`, so its first message begins with the rest of its
header. A header names the message's channel (analysis: reasoning; commentary: tool calls and preambles;
final: the answer), its recipient (`to=functions.NAME`, before or after the channel) and its content type
(`json`, after <|constrain|> or not). `<|end|>` ends a message; `<|call|>` and `<|return|>` end the answer
(gpt-oss' EOS tokens: the output processor leaves them out of the text).

What a chat answer makes of it (vLLM's `openai_gptoss` reasoning parser and `openai` tool parser):

    reasoning    the analysis messages' text
    content      the final messages', and commentary messages to nobody (preambles, meant for the user)
    tool calls   messages to `functions.NAME`: their text is the arguments, streamed as it is written

Messages of a kind are joined with a newline, as vLLM joins them. Text before any header (a model that does
not write harmony) is content; messages to other recipients (gpt-oss' built-in browser and python tools)
are dropped: no built-in tool is served. The markers are special tokens of gpt-oss' tokenizer, so the
server keeps special tokens in a chat answer's text with this parser, whatever skip_special_tokens says.

The text is read once as it streams (`HarmonyReader`): a message's text is searched for its end only where
it grew, so a long answer costs time in proportion to its length.
"""

import re
from dataclasses import dataclass

from jaxpaged.tool_parsers import ToolCallReader, _held_back, register_tool_parser

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_STOPS = (START, *ENDS)             # what ends a message's text
# structured outputs apply from the final channel's header on; a prompt whose last assistant header is it
# (an answer begun in the prompt) is constrained from its first token (runner/structured_outputs.py)
REASONING_TAGS = (START + "assistant", CHANNEL + "final" + MESSAGE)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass
class Message:
    """A message's header: its text is streamed as events (`HarmonyReader.push`)."""
    channel: str | None        # None: text before any header
    recipient: str | None
    content_type: str | None

    @property
    def kind(self) -> str | None:
        """"reasoning", "content", "call" (to a function) or None (a built-in tool's call: dropped)."""
        if self.recipient is None:
            return "reasoning" if self.channel == "analysis" else "content"
        return "call" if self.recipient.startswith(FUNCTIONS) else None

    @property
    def function(self) -> str | None:
        return self.recipient[len(FUNCTIONS):] if self.kind == "call" else None


def speaks_harmony(tokenizer) -> bool:
    """Whether `tokenizer` has harmony's markers as tokens of their own (gpt-oss' has)."""
    if tokenizer is None:
        return False
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = [tokenizer.convert_tokens_to_ids(marker) for marker in (START, CHANNEL, MESSAGE, *ENDS)]
    return all(i is not None and i != unknown for i in ids)


class HarmonyReader:
    """One output read as it streams: `push(new_text, done)` -> its events, each (message index, None) when
    a message's header is whole (the message joins `messages`) or (message index, more of its text). Only
    the text not yet settled is kept: each push costs time in proportion to what it brings."""

    def __init__(self):
        self.messages: list[Message] = []
        self._buffer = ""
        # "first": the output's first text, a header's rest or plain text; "header" (after <|start|>); "text"
        # (the last message's); "between" (after a message's end, before the next <|start|>)
        self._state = "first"
        self._may_be_text = False   # the header being read is the output's first: unfinished, it was text

    def push(self, text: str, done: bool) -> list[tuple[int, str | None]]:
        self._buffer += text
        events: list[tuple[int, str | None]] = []
        while getattr(self, "_" + self._state)(done, events):
            pass
        return events

    def _open(self, message: Message, events: list) -> None:
        self.messages.append(message)
        events.append((len(self.messages) - 1, None))
        self._state = "text"

    def _first(self, done: bool, events: list) -> bool:
        body = self._buffer.lstrip()
        if body.startswith(START):
            self._buffer, self._state = body[len(START):], "header"
        elif body.startswith((CHANNEL, "to=")):
            self._state, self._may_be_text = "header", True
        elif not body or (not done and any(marker.startswith(body) for marker in (CHANNEL, "to=", START))):
            return False   # nothing yet, or what may still become a header
        else:   # no header at all: the text of a model that does not write harmony, content
            self._open(Message(None, None, None), events)
        return True

    def _header(self, done: bool, events: list) -> bool:
        buffer = self._buffer
        end, restart = buffer.find(MESSAGE), buffer.find(START)
        if restart >= 0 and (end < 0 or restart < end):   # a header that never got its text
            self._buffer, self._may_be_text = buffer[restart + len(START):], False
            return True
        if end < 0:
            if done and self._may_be_text:   # the output's first text was no header after all ("to=morrow")
                self._open(Message(None, None, None), events)
                return True
            return False
        self._buffer, self._may_be_text = buffer[end + len(MESSAGE):], False
        self._open(_parse_header(buffer[:end]), events)
        return True

    def _text(self, done: bool, events: list) -> bool:
        buffer, index = self._buffer, len(self.messages) - 1
        stops = [(i, stop) for stop in _STOPS if (i := buffer.find(stop)) >= 0]
        if stops:
            end, stop = min(stops)
            if end:
                events.append((index, buffer[:end]))
            self._buffer = buffer[end + len(stop):]
            self._state = "header" if stop == START else "between"
            return True
        keep = 0 if done else max(_held_back(buffer, stop) for stop in _STOPS)
        if len(buffer) > keep:
            events.append((index, buffer[:len(buffer) - keep]))
            self._buffer = buffer[len(buffer) - keep:]
        return False

    def _between(self, done: bool, events: list) -> bool:
        start = self._buffer.find(START)
        if start >= 0:
            self._buffer, self._state = self._buffer[start + len(START):], "header"
            return True
        keep = 0 if done else _held_back(self._buffer, START)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False


def _parse_header(header: str) -> Message:
    recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
    content_type = None
    if channel is not None:
        words = header[channel.end():].replace(CONSTRAIN, " ").split()
        content_type = next((w for w in reversed(words) if not w.startswith("to=")), None)
    return Message(channel and channel.group(1), recipient and recipient.group(1), content_type)


class HarmonyStream:
    """A chat answer read as it streams (jaxpaged.reasoning's stream interface): `feed(new_text, done)` ->
    (new reasoning, new content). So far: `answer` (the content), `final` (the final channel's text alone:
    what structured outputs constrain, where forced tool calls are read) and `calls` ([function, arguments]
    of each message to a function)."""

    def __init__(self):
        self._reader = HarmonyReader()
        self._began: set[str] = set()   # the kinds ("final" too) of the messages begun: the next is joined by "\n"
        self.answer = self.final = ""
        self.calls: dict[int, list[str]] = {}   # message index -> [function, arguments so far]

    def feed(self, text: str, done: bool) -> tuple[str, str]:
        new = {"reasoning": [], "content": []}
        for index, piece in self._reader.push(text, done):
            message = self._reader.messages[index]
            if message.kind == "call":
                call = self.calls.setdefault(index, [message.function, ""])
                call[1] += piece or ""
                continue
            parts = new.get(message.kind)
            if parts is None:   # a built-in tool's call
                continue
            final = message.channel == "final"
            if piece is None:   # a message begins
                if message.kind in self._began:
                    parts.append("\n")
                if final and "final" in self._began:
                    self.final += "\n"
                self._began.update((message.kind, "final") if final else (message.kind,))
                continue
            parts.append(piece)
            if final:
                self.final += piece
        reasoning, content = "".join(new["reasoning"]), "".join(new["content"])
        self.answer += content
        return reasoning, content


@register_tool_parser("openai")
class HarmonyToolReader(ToolCallReader):
    """gpt-oss' tool calls (vLLM's `openai` parser): commentary messages to `functions.NAME`, read from the
    whole output (its reasoning too, which it leaves out), the arguments streamed as written."""
    keeps_special_tokens = True
    reads_whole_output = True

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._stream = HarmonyStream()
        self._read_chars = 0

    def parse(self, text, done):
        self._stream.feed(text[self._read_chars:], done)
        self._read_chars = len(text)
        return self._stream.answer, [(name, arguments) for name, arguments in self._stream.calls.values()]
