"""Reasoning parsers (vLLM's --reasoning-parser): a thinking model's output split into its reasoning,
written between <think> and </think>, and its answer, whole (`extract`) or as it streams (`stream`).

    parser        the model writes                            no </think> in the output
    deepseek_r1   [<think>] reasoning </think> answer         reasoning (R1 always thinks; cut short)
    qwen3         [<think>] reasoning </think> answer         reasoning, or the answer when thinking is off
                                                              (chat_template_kwargs enable_thinking=False)
    deepseek_v3   as deepseek_r1 with chat_template_kwargs    the answer without {"thinking": true}
                  {"thinking": true} (V3.1), else all answer  (V3.1's thinking is off by default)
    glm45         as qwen3 (GLM-4.5 to 4.7; 4.7's template    as qwen3
                  writes <think> into the prompt)
    minimax_m2    as deepseek_r1 (MiniMax-M2)                 reasoning
    seed_oss      as deepseek_r1, between <seed:think> and    reasoning
                  </seed:think> (Seed-OSS)
    openai_gptoss harmony's channels (gpt-oss; the default     what it wrote: analysis is reasoning, final
                  for its checkpoints): jaxpaged.harmony       and preambles are content

The opening <think> may be the model's or the chat template's (in the prompt): a leading one is dropped.
All work on text, so the tags must survive decoding (they are not special tokens in the <think> models'
tokenizers; harmony's are, and the server keeps them in a chat answer's text: READS_SPECIAL_TOKENS; Seed-OSS'
may be, and its answers keep special tokens unless the request says otherwise: KEEPS_SPECIAL_TOKENS).
A streamed output always reassembles to the whole one: `extract` is the stream fed at once.
"""

from __future__ import annotations

from jaxpaged import harmony

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "glm45", "minimax_m2", "openai_gptoss", "qwen3", "seed_oss")
START, END = "<think>", "</think>"
_TAGS = {"openai_gptoss": harmony.REASONING_TAGS, "seed_oss": ("<seed:think>", "</seed:think>")}
READS_SPECIAL_TOKENS = {"openai_gptoss"}
KEEPS_SPECIAL_TOKENS = {"seed_oss"}


def reasoning_tags(name: str) -> tuple[str, str]:
    """The text that opens and the text that closes a parser's reasoning (structured outputs wait for the
    second; a prompt where it comes last starts with the answer)."""
    return _TAGS.get(name, (START, END))


class ReasoningParser:
    def __init__(self, name: str, chat_template_kwargs: dict | None = None):
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
        self.name = name
        kwargs = chat_template_kwargs or {}
        # Qwen3's and GLM's templates write an empty <think></think> into the prompt when thinking is off: all
        # is answer; DeepSeek-V3.1's thinks only when asked
        enabled = kwargs.get("enable_thinking", True) is not False
        self.thinking = {"qwen3": enabled, "glm45": enabled,
                         "deepseek_v3": kwargs.get("thinking", False) is True}.get(name, True)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; None where a part is empty."""
        stream = self.stream()
        reasoning, answer = stream.feed(text, done=True)
        return reasoning or None, answer or None

    def stream(self) -> ReasoningStream | harmony.HarmonyStream:
        if self.name == "openai_gptoss":
            return harmony.HarmonyStream()
        return ReasoningStream(self.thinking, *reasoning_tags(self.name))


class ReasoningStream:
    """One streamed output: `feed(new_text, done)` -> (new reasoning, new answer); text that may still
    become a tag is held back until the next feed (or `done`). `answer` is the answer so far."""

    def __init__(self, thinking: bool, start: str = START, end: str = END):
        self.start, self.end = start, end
        self.in_reasoning = thinking
        self.began = not thinking   # past the point where a leading <think> is dropped
        self.held = ""
        self.answer = ""

    @property
    def final(self) -> str:
        """What structured outputs constrained (the answer; harmony's final channel): forced calls are read here."""
        return self.answer

    def feed(self, text: str, done: bool) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning = ""
        if self.in_reasoning and not self.began:
            body = text.lstrip()
            if body.startswith(self.start):
                text, self.began = body[len(self.start):], True
            elif self.start.startswith(body) and not done:   # whitespace, or "<thi": wait for more
                self.held = text
                return "", ""
            else:
                self.began = True
        if self.in_reasoning:
            end = text.find(self.end)
            if end >= 0:
                reasoning, text, self.in_reasoning = text[:end], text[end + len(self.end):], False
            else:
                keep = 0 if done else _partial_suffix(text, self.end)
                reasoning, self.held, text = text[:len(text) - keep], text[len(text) - keep:], ""
        self.answer += text
        return reasoning, text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
