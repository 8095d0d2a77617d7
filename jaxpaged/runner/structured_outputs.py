"""Structured outputs on the host: one llguidance matcher per constrained sequence.

llguidance compiles a request's constraint (JSON schema, regex, choice, Lark grammar) against
the model's tokenizer once, when the request is added (a bad constraint is a ValueError then),
and after each sampled token fills that sequence's row of the step's token bitmask
(`[rows, ceil(vocab / 32)]` i32, bit j of word w allows token 32 w + j) through its numpy
interface. The runner fills a step's rows while its forward runs (after the previous step's
tokens were applied), sends the bitmask with the step's sampler, and the sampler masks
disallowed tokens on the device. A row whose request finished meanwhile allows everything. Tokens past the tokenizer's vocabulary (a padded embedding) are never allowed.

A request's matcher advances on each of its tokens as the engine applies them; preemption
keeps it (recompute re-prefills tokens the matcher already consumed; nothing rolls back).

With a reasoning parser (EngineArgs.reasoning_parser, vLLM's), a thinking model thinks first: its
matcher (AfterReasoning) allows every token until the output holds the end-of-reasoning tag's tokens
(</think>; gpt-oss' final channel header), and the constraint applies to what follows; a prompt whose
reasoning already ended (Qwen3's template with enable_thinking=False writes <think></think>) is
constrained from its first token.

Bad words of several tokens ride the same mask: the row of a request whose output ends with all but
the last token of one has that token's bit cleared (a word of one token is banned on the device
from the start, through the request's logit_bias row: runner/persistent_batch.py).
"""

import json
import re

import numpy as np

from jaxpaged.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Builds matchers for one engine's tokenizer (its llguidance tokenizer is built on first use)."""

    def __init__(self, tokenizer, vocab_size: int, reasoning_parser: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None
        self.reasoning_tags = None   # (start, end) token ids of the reasoning parser's tags
        if reasoning_parser is not None and tokenizer is not None:
            from jaxpaged.reasoning import reasoning_tags
            self.reasoning_tags = tuple(tuple(tokenizer.encode(tag, add_special_tokens=False))
                                        for tag in reasoning_tags(reasoning_parser))

    def _ll(self):
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer; this engine has none")
            import llguidance.hf
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    def grammar(self, params: StructuredOutputsParams) -> str:
        from llguidance import LLMatcher

        kind = params.kind
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            return LLMatcher.grammar_from_json_schema(schema)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in params.choice))
        grammar = params.grammar
        if "::=" in grammar:   # GBNF (llama.cpp's EBNF) -> Lark
            from llguidance import gbnf_to_lark
            grammar = gbnf_to_lark(grammar)
        return LLMatcher.grammar_from_lark(grammar)

    def matcher(self, params: StructuredOutputsParams, prompt_ids: list[int] = ()):
        """A fresh matcher at the start of the output (with a reasoning parser: after the output's
        reasoning, unless `prompt_ids` ended it); ValueError naming the field when the constraint
        does not compile."""
        matcher = self._matcher(params)
        if self.reasoning_tags is None or reasoning_ended(prompt_ids, *self.reasoning_tags):
            return matcher
        return AfterReasoning(matcher, self.reasoning_tags[1])

    def _matcher(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        try:
            grammar = self.grammar(params)
        except ValueError:
            raise
        except Exception as exc:   # llguidance raises its own types for malformed schemas
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {exc}") from None
        matcher = LLMatcher(self._ll(), grammar)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {matcher.get_error()}")
        return matcher


def step_bitmask(constrained: list[tuple[int, object]], num_rows: int, words: int) -> np.ndarray | None:
    """A step's bitmask i32[num_rows, words] from its constrained (sample row, Request) pairs (those
    whose `needs_host_mask`: the tokens the grammar allows, less the bad words' bans), the other rows
    allowing everything; None when no row is constrained. A request that finished meanwhile (its token
    will be dropped) allows everything too."""
    if not constrained:
        return None
    bitmask = np.full((num_rows, words), -1, np.int32)
    bits = bitmask.view(np.uint32)
    for row, request in constrained:
        if request.is_finished:
            continue
        matcher = request.matcher
        if isinstance(matcher, AfterReasoning):   # still thinking: any token
            matcher = matcher.matcher if matcher.active else None
        if matcher is not None:
            fill_bitmask(bitmask, row, matcher)
        for token in request.bad_word_bans():
            bits[row, token >> 5] &= ~np.uint32(1 << (token & 31))
    return bitmask


def fill_bitmask(bitmask: np.ndarray, row: int, matcher) -> None:
    """Row `row` of `bitmask` := the tokens `matcher` allows next."""
    from llguidance.numpy import fill_next_token_bitmask
    fill_next_token_bitmask(matcher, bitmask, row)


class AfterReasoning:
    """A matcher that lets the model think first: every token goes through until the output ends with
    `end_ids` (the end-of-reasoning tag), then the grammar's matcher applies to the tokens after it."""

    def __init__(self, matcher, end_ids: tuple[int, ...]):
        self.matcher = matcher
        self.end_ids = list(end_ids)
        self.active = False
        self._tail: list[int] = []

    def consume_token(self, token: int) -> bool:
        if self.active:
            return self.matcher.consume_token(token)
        self._tail = (self._tail + [token])[-len(self.end_ids):]
        self.active = self._tail == self.end_ids
        return True

    def is_stopped(self) -> bool:
        return self.active and self.matcher.is_stopped()

    def get_error(self) -> str:
        return self.matcher.get_error()


def reasoning_ended(prompt_ids, start_ids: tuple[int, ...], end_ids: tuple[int, ...]) -> bool:
    """Whether the prompt closes its last reasoning (its last tag is the end tag: a template that turned
    thinking off), so that the output starts with the answer."""
    return _last_end(prompt_ids, end_ids) > _last_end(prompt_ids, start_ids)


def _last_end(ids, tag: tuple[int, ...]) -> int:
    """Where the last occurrence of `tag` in `ids` ends (-1: none); numpy finds the candidates."""
    ids = np.asarray(ids, np.int64)
    for end in np.flatnonzero(ids == tag[-1])[::-1] + 1:
        if end >= len(tag) and tuple(ids[end - len(tag):end].tolist()) == tag:
            return int(end)
    return -1
