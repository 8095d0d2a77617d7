"""The incremental detokenizer on offline tokenizers: byte-level BPE, SentencePiece-style
with byte fallback, and SmolLM2's real one when it can be loaded."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxpaged.engine.detokenizer import IncrementalDetokenizer, decode_token

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
    for bad in (len(byte_bpe), -1):
        with pytest.raises(ValueError, match=rf"token_id must be in \[0, {len(byte_bpe)}\), got {bad}"):
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
