"""The incremental detokenizer on offline tokenizers: byte-level BPE, SentencePiece-style
with byte fallback, and SmolLM2's real one when it can be loaded."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxpaged.engine.detokenizer import IncrementalDetokenizer, decode_ids, decode_token

FFFD = "\ufffd"
TEXTS = [
    "你好，世界！今天天气很好。",
    "emoji 😀🎉🚀 party 👍🏽 ok",
    "中文和English混合 text 🙂 naïve café",
    "Hello world, the capital of France is Paris.",
]


@pytest.fixture(scope="module")
def byte_bpe():
    # Small vocab: some CJK characters merge into one token, others stay 2-3 byte tokens.
    corpus = TEXTS[:3] * 3 + ["Hello world, the capital of France is Paris."] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def sentencepiece_bpe():
    # Llama-2 style: "▁" for spaces, and byte tokens <0xNN> for every character the
    # English-only vocab lacks, so each CJK character and emoji is 3-4 tokens.
    corpus = ["Hello world, the capital of France is Paris.", "The quick brown fox jumps over the lazy dog!"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(corpus * 3, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    for byte in range(256):
        spec["model"]["vocab"][f"<0x{byte:02X}>"] = len(spec["model"]["vocab"])
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, prompt_ids, output_ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = [detok.add_tokens(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    return detok, deltas


@pytest.mark.parametrize("tokenizer_name", ["byte_bpe", "sentencepiece_bpe"])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode_without_partial_characters(request, tokenizer_name, text):
    tokenizer = request.getfixturevalue(tokenizer_name)
    ids = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, [], ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == text
    assert detok.token_ids == ids


@pytest.mark.parametrize("tokenizer_name", ["byte_bpe", "sentencepiece_bpe"])
def test_split_characters_are_held_back_until_complete(request, tokenizer_name):
    tokenizer = request.getfixturevalue(tokenizer_name)
    ids = tokenizer.encode("你")
    assert len(ids) > 1, "test needs a character spread over several tokens"
    detok, deltas = stream(tokenizer, [], ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "你"


def test_several_tokens_per_call_give_the_same_text(byte_bpe):
    ids = byte_bpe.encode(TEXTS[2])
    for chunk in (2, 3, 7):
        detok, deltas = stream(byte_bpe, [], ids, chunk=chunk)
        assert all(FFFD not in d for d in deltas)
        assert detok.output_text == TEXTS[2]


def test_byte_level_output_after_prompt_keeps_its_leading_space(byte_bpe):
    prompt = byte_bpe.encode("Hello world, the capital of")
    output = byte_bpe.encode(" France is Paris 你好 😀")
    detok, _ = stream(byte_bpe, prompt, output)
    assert detok.output_text == byte_bpe.decode(output) == " France is Paris 你好 😀"


@pytest.mark.parametrize("tokenizer_name", ["byte_bpe", "sentencepiece_bpe"])
def test_output_continues_the_prompt_at_every_split_point(request, tokenizer_name):
    # Split a sentence after every token: mid-word ("Par" | "is") and between words.
    tokenizer = request.getfixturevalue(tokenizer_name)
    ids = tokenizer.encode("The capital of France is Paris 你好!")
    full = tokenizer.decode(ids)
    for split in range(1, len(ids)):
        prompt_text = tokenizer.decode(ids[:split])
        if prompt_text.endswith(FFFD):
            continue  # the prompt ends inside a character: covered below
        detok, _ = stream(tokenizer, ids[:split], ids[split:])
        assert prompt_text + detok.output_text == full, f"split after token {split}"


def test_sentencepiece_word_after_prompt_gets_its_space_and_mid_word_does_not(sentencepiece_bpe):
    tok = sentencepiece_bpe
    ids = tok.encode("The capital is Paris")
    tokens = tok.convert_ids_to_tokens(ids)
    word_start = tokens.index("▁is")
    detok, _ = stream(tok, ids[:word_start], ids[word_start:])
    assert detok.output_text == " is Paris"  # decode(ids) alone would drop this space
    mid_word = next(i for i, t in enumerate(tokens) if i > 0 and not t.startswith("▁"))
    detok, _ = stream(tok, ids[:mid_word], ids[mid_word:])
    assert tok.decode(ids[:mid_word]) + detok.output_text == "The capital is Paris"
    assert not detok.output_text.startswith(" ")


def test_prompt_ending_inside_a_character_decodes_output_on_its_own(byte_bpe):
    ids = byte_bpe.encode("你好")
    detok, _ = stream(byte_bpe, ids[:1], ids[1:])
    assert detok.output_text == byte_bpe.decode(ids[1:])


def test_flush_releases_a_character_cut_off_by_the_end_of_generation(byte_bpe):
    ids = byte_bpe.encode("ok 😀")[:-1]
    detok, deltas = stream(byte_bpe, [], ids)
    assert FFFD not in detok.output_text
    tail = detok.flush()
    assert tail.endswith(FFFD)
    assert detok.output_text == byte_bpe.decode(ids)
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(byte_bpe, skip):
    eos, im_start = byte_bpe.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"])
    ids = byte_bpe.encode("你好") + [im_start] + byte_bpe.encode(" ok") + [eos, eos]
    detok, _ = stream(byte_bpe, [im_start], ids, skip_special_tokens=skip)
    assert detok.output_text == byte_bpe.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in detok.output_text) is not skip
    assert detok.token_ids == ids


class _CountingBackend:
    """Wraps a Rust tokenizer and records how many ids each decode call sees."""

    def __init__(self, backend):
        self._backend = backend
        self.decoded_lengths = []

    def decode(self, ids, skip_special_tokens):
        self.decoded_lengths.append(len(ids))
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_added_tokens_decoder(self):
        return self._backend.get_added_tokens_decoder()

    def get_vocab_size(self, with_added_tokens):
        return self._backend.get_vocab_size(with_added_tokens=with_added_tokens)


def test_cost_per_token_does_not_grow_with_output_length(byte_bpe):
    # A long output with a run of skipped EOS tokens (as with ignore_eos): the decoded
    # window must stay a few tokens wide instead of growing with the output.
    eos = byte_bpe.eos_token_id
    ids = byte_bpe.encode(" ".join(TEXTS) * 20) + [eos] * 200 + byte_bpe.encode("你好 😀")
    counting = _CountingBackend(byte_bpe.backend_tokenizer)

    class Wrapped:
        backend_tokenizer = counting

    detok, _ = stream(Wrapped(), byte_bpe.encode("prompt"), ids)
    assert len(ids) > 1000
    assert max(counting.decoded_lengths) <= 12
    assert detok.output_text == byte_bpe.decode(ids, skip_special_tokens=True)


def test_decode_token_shows_the_tokens_own_text(byte_bpe):
    space_paris = byte_bpe.encode(" Paris")
    assert "".join(decode_token(byte_bpe, i) for i in space_paris) == " Paris"
    assert decode_token(byte_bpe, byte_bpe.eos_token_id) == "<|endoftext|>"
    # an id past the vocabulary is a padding row of the model's embedding: it reads as ""
    assert decode_token(byte_bpe, len(byte_bpe)) == decode_token(byte_bpe, len(byte_bpe) + 1000) == ""
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match=rf"token_id must be a non-negative int, got {bad}"):
            decode_token(byte_bpe, bad)


def test_smollm2_tokenizer_streams_chat_text_exactly():
    try:
        from tests.fixtures_smollm2 import smollm2_tokenizer

        tokenizer = smollm2_tokenizer()
    except Exception as exc:  # the fixture module or the GGUF package may be missing
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc!r}")
    prompt = tokenizer.encode("<|im_start|>user\nSay hi in Chinese<|im_end|>\n<|im_start|>assistant\n")
    text = "你好！😀 Hello 👍🏽, naïve café — 中文和English混合.<|im_end|>"
    output = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, prompt, output)
    assert all(FFFD not in d for d in deltas)
    assert detok.output_text == tokenizer.decode(output, skip_special_tokens=True) == text[: -len("<|im_end|>")]


# Fast tokenizers decode through tokenizers' DecodeStream; the Python window is the path of
# slow tokenizers. A tokenizer whose backend is not a Rust `tokenizers.Tokenizer` takes the
# window with the same decoder, which lets the two paths be compared on one vocabulary.
def window_only(tokenizer):
    class WindowOnly:
        backend_tokenizer = _CountingBackend(tokenizer.backend_tokenizer)

    return WindowOnly()


def test_fast_tokenizer_streams_through_decode_stream(byte_bpe, monkeypatch):
    def no_window(self, force):
        raise AssertionError("the Python window decoded a fast tokenizer's output")

    ids = byte_bpe.encode(TEXTS[1])
    assert IncrementalDetokenizer(byte_bpe, []).uses_decode_stream
    assert not IncrementalDetokenizer(window_only(byte_bpe), []).uses_decode_stream
    monkeypatch.setattr(IncrementalDetokenizer, "_emit", no_window)
    detok, deltas = stream(byte_bpe, byte_bpe.encode("Hello"), ids)
    assert detok.uses_decode_stream
    assert "".join(deltas) == detok.output_text == TEXTS[1]


def _tricky_ids(tokenizer, specials: list[str]) -> list[list[int]]:
    special_ids = tokenizer.convert_tokens_to_ids(specials)
    padding = len(tokenizer) + 7   # a model's embedding row past the tokenizer's vocabulary
    cases = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS + ["  two  spaces \n\n and lines "]]
    cases.append(tokenizer.encode("你好", add_special_tokens=False) + special_ids
                 + tokenizer.encode(" ok 😀", add_special_tokens=False) + special_ids[:1])
    emoji = tokenizer.encode("a 😀🎉", add_special_tokens=False)
    cases.append(emoji[:-2] + [padding] + emoji[-2:-1] + [padding, padding] + emoji[-1:])   # inside a character
    cases.append([padding] + tokenizer.encode(" Paris", add_special_tokens=False) + [padding])
    return cases


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("tokenizer_name,specials", [("byte_bpe", ["<|im_start|>", "<|endoftext|>"]),
                                                     ("sentencepiece_bpe", ["<s>", "</s>"])])
def test_decode_stream_and_window_agree_on_tricky_strings(request, tokenizer_name, specials, skip):
    tokenizer = request.getfixturevalue(tokenizer_name)
    for ids in _tricky_ids(tokenizer, specials):
        for split in sorted({0, 1, len(ids) // 2, len(ids) - 1}):
            for chunk in (1, 3):
                results = []
                for tok in (tokenizer, window_only(tokenizer)):
                    detok, deltas = stream(tok, ids[:split], ids[split:], chunk=chunk, skip_special_tokens=skip)
                    results.append((deltas + [detok.flush()], detok.output_text))
                assert results[0] == results[1], (ids, split, chunk)
                in_vocab = [i for i in ids[split:] if i < len(tokenizer)]
                if split == 0:
                    assert results[0][1] == tokenizer.decode(in_vocab, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def byt5():
    # A real slow (pure Python) tokenizer: one token per UTF-8 byte, and decode raises on an
    # id past its 384 tokens.
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def test_slow_tokenizer_streams_by_window_and_skips_padding_ids(byt5):
    padding = len(byt5) + 20
    with pytest.raises(ValueError):
        byt5.decode([padding])
    text = "naïve 東京 😀 ok"
    ids = byt5.encode(text, add_special_tokens=False)
    with_padding = ids[:8] + [padding] + ids[8:] + [padding, byt5.eos_token_id]
    detok, deltas = stream(byt5, byt5.encode("prompt", add_special_tokens=False), with_padding)
    assert not detok.uses_decode_stream
    assert all(FFFD not in d for d in deltas)
    assert detok.output_text == text
    assert decode_token(byt5, padding) == ""
    assert decode_ids(byt5, with_padding) == text


def test_padding_ids_decode_to_nothing_on_the_fast_path(byte_bpe):
    padding = len(byte_bpe)
    ids = [padding] * 50 + byte_bpe.encode(" Paris 😀") + [padding]
    detok, deltas = stream(byte_bpe, [padding], ids)
    assert detok.uses_decode_stream
    assert detok.output_text == " Paris 😀" == decode_ids(byte_bpe, ids)
    assert detok.token_ids == ids


def test_several_tokens_a_step_detokenize_as_one_at_a_time():
    """Speculative decoding hands a request several tokens per step: with stop strings they are added
    one by one (a stop string inside the step drops the tokens after it), and the text, multi-byte
    characters included, is the one-token-a-step text."""
    from jaxpaged import SamplingParams
    from jaxpaged.core.request import Request
    from jaxpaged.engine.output_processor import SequenceState, detokenize
    from tests.fixtures_smollm2 import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode("Hello 世界, 日本語のテキスト! 🙂 done", add_special_tokens=False)

    def run(steps, stop):
        request = Request("r", [ids[0]], SamplingParams(temperature=0, stop=stop, max_tokens=100))
        seq = SequenceState(request, 0, tokenizer, "r")
        pos, matched = 0, None
        for n in steps:
            seq.token_ids += ids[pos:pos + n]   # the output side's copy of the sequence's tokens
            pos += n
            if pos == len(ids):
                seq.finish_reason = "length"
            matched = detokenize(seq) or matched
        return seq.text, seq.token_ids, seq.num_dropped, matched

    one = run([1] * len(ids), ["zzz"])
    assert run([len(ids) - 6, 6], ["zzz"])[:2] == one[:2]
    text, tokens, dropped, matched = run([2, len(ids) - 2], ["テキ"])
    assert matched is not None and matched[0] == "テキ" and dropped > 0
    assert len(tokens) == len(ids) - dropped and "テキ" in tokenizer.decode(tokens)
