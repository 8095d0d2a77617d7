"""Incremental detokenization: token ids in, finished text out, a few tokens at a time.

Decoding one token on its own is wrong in two ways. A byte-level token can carry half a
UTF-8 character (a CJK character or an emoji is often 2-4 tokens), which decodes to
U+FFFD; and SentencePiece-style decoders drop the leading space of the first token they
see, so "▁Paris" alone loses its space. Like vLLM, we therefore decode a short window:

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 [  already emitted   ][   not emitted yet  ]

`decode(ids[prefix_offset:read_offset])` is text the caller already has; the window
`decode(ids[prefix_offset:])` minus that prefix is the new text. The prefix gives the
decoder the context it needs for spaces. When the window text ends in U+FFFD, the last
character is still incomplete: nothing is emitted and the window grows until a later
token completes it. Each call decodes only the window, so its cost does not grow with the
length of the output.

The window starts with the last few prompt tokens, so the first output token is decoded
as a continuation of the prompt (vLLM's behaviour: "▁Paris" after a prompt reads " Paris").

A fast tokenizer (one with a Rust `tokenizers.Tokenizer` behind it) runs this same
algorithm inside `tokenizers.decoders.DecodeStream`, one Rust call per step instead of two
decodes from Python; a slow tokenizer takes the Python window above. Both keep the window
offsets, so `flush` works the same on either path. (DecodeStream takes the prompt context
as prefill ids; its window test compares UTF-8 bytes where ours compares characters, which
differs only on invalid UTF-8 such as random byte-fallback tokens.)

Ids past the end of the tokenizer's vocabulary (a checkpoint's padding rows: Qwen2.5 has
151,936 embedding rows for 151,665 tokens) can still be sampled; like vLLM they decode to
"" and never raise.
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

# vLLM starts its window this many tokens before the end of the prompt.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text as they arrive."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # The Rust tokenizer decodes a window without transformers' Python wrapper; it is
        # what `PreTrainedTokenizerFast.decode` calls, so both give the same text.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skipped_ids = _special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._vocab_size = vocab_size(tokenizer)

        self.token_ids: list[int] = []
        self.output_text = ""
        # Ids the decoder sees: prompt context, then output ids minus skipped specials and
        # out-of-vocabulary ids. Dropping those here (decode would drop them anyway) keeps
        # a long run of them (e.g. EOS with ignore_eos) from widening the window.
        self._ids = self._prompt_context(list(prompt_token_ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The fast path; None for a slow tokenizer (or after the stream gave up, see _emit_stream).
        # It starts from the same prompt context as the window, so their offsets stay in step.
        self._stream = (DecodeStream(self._ids, skip_special_tokens=skip_special_tokens)
                        if isinstance(self._backend, tokenizers.Tokenizer) else None)

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    def _kept(self, ids: list[int]) -> list[int]:
        return [i for i in ids if 0 <= i < self._vocab_size and i not in self._skipped_ids]

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        ids = self._kept(prompt_token_ids)
        context = ids[-_PROMPT_CONTEXT_TOKENS:]
        # A prompt that ends mid-character would make the first output token "complete"
        # a prompt character; decode the output on its own instead.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append generated ids; returns the newly finished text (possibly "").

        Changes state: `token_ids` grows by all of `new_token_ids`, `output_text` by the
        returned delta. Text of an incomplete trailing character is held back.
        """
        self.token_ids.extend(new_token_ids)
        kept = self._kept(new_token_ids)
        if not kept:
            return ""
        self._ids.extend(kept)
        if self._stream is not None:
            return self._emit_stream(kept)
        return self._emit(force=False)

    def flush(self) -> str:
        """Emit whatever is held back, even an incomplete character (as U+FFFD).

        For the end of a request: afterwards `output_text` equals the tokenizer's decode of
        all output ids (also when the model stopped in the middle of a character).
        """
        if self._read_offset == len(self._ids):
            return ""
        # The stream still holds what is forced out here; anything after (nothing, normally)
        # goes through the window, which knows where the forced text ended.
        self._stream = None
        return self._emit(force=True)

    def _emit_stream(self, kept: list[int]) -> str:
        try:
            delta = self._stream.step(self._backend, kept)
        except Exception:
            # DecodeStream refuses a window whose text does not start with its prefix's
            # text (InvalidPrefix); the Python window takes over this sequence from here.
            self._stream = None
            return self._emit(force=False)
        if delta is None:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def _emit(self, force: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if not force and (len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.output_text += delta
        return delta


def _special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that `decode(..., skip_special_tokens=True)` leaves out."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust decoder skips exactly the added tokens flagged special.
        return frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


def vocab_size(tokenizer: Any) -> int:
    """How many ids the tokenizer can decode (added tokens included)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.get_vocab_size(with_added_tokens=True)
    return len(tokenizer)


def decode_ids(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """`tokenizer.decode` of a whole sequence, ids past the vocabulary (padding rows) left out."""
    size = vocab_size(tokenizer)
    return tokenizer.decode([i for i in token_ids if 0 <= i < size], skip_special_tokens=skip_special_tokens)


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own, as vLLM shows it in `Logprob.decoded_token`.

    A byte-level token keeps its leading space ("ĠParis" -> " Paris"); a token holding
    part of a UTF-8 character reads as U+FFFD; a special token reads as its own text; an id
    past the vocabulary (a padding row of the model's embedding) reads as "".
    Raises ValueError for a negative or non-integer id.
    """
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise ValueError(f"token_id must be a non-negative int, got {token_id!r}")
    if token_id >= vocab_size(tokenizer):
        return ""
    token = tokenizer.convert_ids_to_tokens(token_id)
    if token is None:  # a hole in the vocabulary
        return ""
    return tokenizer.convert_tokens_to_string([token])
