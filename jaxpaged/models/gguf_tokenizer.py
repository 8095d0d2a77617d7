"""Build a GGUF file's tokenizer from its metadata, without torch.

A GGUF has no `tokenizer.json`: llama.cpp stores the vocabulary, merges, token types and
special ids as `tokenizer.*` metadata. transformers can turn those into a tokenizer
(`AutoTokenizer.from_pretrained(folder, gguf_file=name)`), but its GGUF reader imports
torch, which the runtime does not install. This module reads the same metadata with the
`gguf` package and assembles the same `tokenizers` pipeline transformers builds, so ids,
tokens and decoded text are the same:

    tokenizer.ggml.model  pipeline
    "gpt2"                byte-level BPE with the file's merges; the pre-tokenizer regex is
                          picked by tokenizer.ggml.pre (GPT-2's own when the name is unknown)
    "llama"               SentencePiece-style BPE with byte fallback and "▁" for spaces;
                          merges from the file, else rebuilt from the token scores

Any other type falls back to transformers' own conversion when torch is installed.
"""

import dataclasses
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from jaxpaged.models.gguf_file import GGUFFile

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

# llama.cpp's token types (llama_token_type).
_CONTROL = 3        # <|im_start|>, <s>: special tokens, matched whole and skippable on decode
_USER_DEFINED = 4   # <think>: matched whole, but decoded like text

# The pre-tokenizer regexes transformers applies for each `tokenizer.ggml.pre` name. Names
# missing here (SmolLM2's "smollm" among them) keep GPT-2's built-in byte-level regex,
# as transformers does.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_NOT_LETTER_OR_DIGIT = r"[^\r\n\p{L}\p{N}]?"
_WHITESPACE = r"\s*[\r\n]+|\s+(?!\S)|\s+"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_LLAMA3 = rf"{_CONTRACTIONS}|{_NOT_LETTER_OR_DIGIT}\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|{_WHITESPACE}"
_QWEN2 = rf"{_CONTRACTIONS}|{_NOT_LETTER_OR_DIGIT}\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|{_WHITESPACE}"
_QWEN35 = (
    rf"{_CONTRACTIONS}|{_NOT_LETTER_OR_DIGIT}[\p{{L}}\p{{M}}]+|\p{{N}}"
    rf"| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+[\r\n]*|{_WHITESPACE}"
)
_TEKKEN = (
    rf"{_NOT_LETTER_OR_DIGIT}{_UPPER}*{_LOWER}+|{_NOT_LETTER_OR_DIGIT}{_UPPER}+{_LOWER}*"
    rf"|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|{_WHITESPACE}"
)
_GPT4O = (
    rf"{_NOT_LETTER_OR_DIGIT}{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|{_NOT_LETTER_OR_DIGIT}{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    rf"|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|{_WHITESPACE}"
)
PRE_TOKENIZER_REGEXES = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of a GGUF file (llama.cpp's `tokenizer.*` keys)."""

    model: str                    # tokenizer.ggml.model: "gpt2", "llama", ...
    pre: str | None               # tokenizer.ggml.pre: names the pre-tokenizer
    tokens: list[str]             # [vocab_size] token text as the file spells it
    token_types: list[int]        # [vocab_size] llama.cpp token type (1 normal, 3 control, ...)
    scores: list[float] | None    # [vocab_size] SentencePiece scores, higher merges first
    merges: list[str] | None      # ["left right", ...] best first
    special_tokens: dict[str, str | None]  # "bos_token" -> its text, None when the file names none
    add_bos_token: bool | None
    add_eos_token: bool | None
    chat_template: str | None


_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def read_gguf_vocab(reader: GGUFFile) -> GGUFVocab:
    """Read the tokenizer metadata; raises ValueError when the file has no vocabulary."""
    field = reader.get

    model, tokens = field("tokenizer.ggml.model"), field("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ValueError("the GGUF file has no tokenizer: tokenizer.ggml.model or tokenizer.ggml.tokens is missing")
    special_tokens = {}
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = field(key)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"{key}={token_id} is outside the vocabulary [0, {len(tokens)})")
        special_tokens[name] = None if token_id is None else tokens[token_id]
    return GGUFVocab(
        model=model,
        pre=field("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=field("tokenizer.ggml.token_type") or [],
        scores=field("tokenizer.ggml.scores"),
        merges=field("tokenizer.ggml.merges"),
        special_tokens=special_tokens,
        add_bos_token=field("tokenizer.ggml.add_bos_token"),
        add_eos_token=field("tokenizer.ggml.add_eos_token"),
        chat_template=field("tokenizer.chat_template"),
    )


def build_gguf_tokenizer(path: str):
    """Return the tokenizer of the GGUF file at `path`, the one transformers would build.

    Raises ValueError for a tokenizer.ggml.model other than SUPPORTED_TOKENIZER_MODELS when
    torch (which transformers' own GGUF conversion needs) is not installed.
    """
    vocab = read_gguf_vocab(GGUFFile(path))
    if vocab.model == "gpt2":
        backend = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        backend = _sentencepiece_bpe(vocab)
    else:
        return _transformers_fallback(path, vocab.model)
    _add_vocab_special_tokens(backend, vocab)
    regex = PRE_TOKENIZER_REGEXES.get(vocab.pre)
    if regex is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    add_bos_token = vocab.add_bos_token
    if add_bos_token is None and vocab.model == "llama":
        add_bos_token = True  # llama.cpp adds BOS to a SentencePiece vocabulary unless told not to
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=vocab.chat_template,
        add_bos_token=bool(add_bos_token),
        add_eos_token=bool(vocab.add_eos_token),
        **vocab.special_tokens,
    )


def _byte_level_bpe(vocab: GGUFVocab) -> Tokenizer:
    byte_chars = _byte_chars()
    alphabet = set(byte_chars)
    # Tokens are stored in GPT-2's byte alphabet, except that llama.cpp writes some special
    # tokens as raw text; those are respelled byte by byte, as transformers does.
    spelled = {}
    for token_id, token in enumerate(vocab.tokens):
        if not set(token) <= alphabet:
            token = "".join(byte_chars[byte] for byte in token.encode("utf-8"))
        spelled[token] = token_id
    backend = Tokenizer(BPE(
        vocab=spelled, merges=_merges(vocab), dropout=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    ))  # fmt: skip
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # transformers' GPT-2 tokenizer brings "<|endoftext|>" as its default special token, a new
    # id past the vocabulary when the file has no such token; kept so ids match.
    backend.add_special_tokens([AddedToken("<|endoftext|>", normalized=False, special=True)])
    return backend


def _sentencepiece_bpe(vocab: GGUFVocab) -> Tokenizer:
    ids = {token: token_id for token_id, token in enumerate(vocab.tokens)}
    backend = Tokenizer(BPE(vocab=ids, merges=_merges(vocab), fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])  # fmt: skip
    # transformers' Llama tokenizer brings these defaults (new ids when the file lacks them).
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<s>", "</s>", "<unk>")])
    return backend


def _merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    if vocab.merges is not None:
        return [tuple(merge.split(" ")) for merge in vocab.merges]
    if vocab.scores is None:
        raise ValueError(
            f"tokenizer.ggml.model={vocab.model!r} needs tokenizer.ggml.merges or tokenizer.ggml.scores; "
            "the file has neither"
        )
    return merges_from_scores(vocab.tokens, vocab.scores)


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Rebuild BPE merges from a SentencePiece vocabulary, best first.

    Every way to cut a token into two tokens of the vocabulary is a merge; merges rank by the
    score of the token they make (then longer left, then longer right piece), and ties keep
    vocabulary order: the order transformers derives, so the BPE splits text the same way.
    """
    ids = {token: token_id for token_id, token in enumerate(tokens)}
    ranked = []  # (score, left, right)
    for token, score in dict(zip(tokens, scores)).items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ids and token[i:] in ids]
        cuts.sort(key=lambda cut: (ids[cut[0]], ids[cut[1]]))
        ranked.extend((score, left, right) for left, right in cuts)
    ranked.sort(key=lambda merge: (-merge[0], -len(merge[1]), -len(merge[2])))  # stable: ties keep order
    return [(left, right) for _, left, right in ranked]


def _add_vocab_special_tokens(backend: Tokenizer, vocab: GGUFVocab) -> None:
    """Keep control and user-defined tokens whole: `<|im_start|>` encodes to one id.

    Control tokens become special (skipped by `skip_special_tokens`); user-defined ones stay
    plain text on decode. A byte-level control token spelled outside the byte alphabet is a
    llama.cpp mislabel and is skipped, as transformers does.
    """
    byte_level = vocab.model == "gpt2"
    alphabet = set(_byte_chars())
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(vocab.tokens, vocab.token_types)
        if token_type == _CONTROL and (not byte_level or set(token) <= alphabet)
    ]
    backend.add_special_tokens(control)
    known = backend.get_vocab(with_added_tokens=True)
    backend.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(vocab.tokens, vocab.token_types)
        if token_type == _USER_DEFINED and token in known
    ])  # fmt: skip


def _byte_chars() -> list[str]:
    """GPT-2's byte alphabet: byte -> the printable character that spells it.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, ...) map to
    U+0100 onwards in byte order, so every token is a visible, whitespace-free string.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def _transformers_fallback(path: str, model: str):
    try:
        import torch  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ValueError(
            f"cannot build the tokenizer of {path!r} without torch: tokenizer.ggml.model={model!r}; "
            f"supported without torch: {list(SUPPORTED_TOKENIZER_MODELS)}"
        ) from None
    import transformers

    folder, name = os.path.split(os.path.abspath(path))
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
