"""The torch-free GGUF tokenizer against transformers' own GGUF conversion (which needs torch)."""

import json
import os
import random
import re
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest

from tests.fixtures_smollm2 import smollm2_path, smollm2_tokenizer

from jaxpaged.models.gguf_loader import load_gguf_tokenizer
from jaxpaged.models.gguf_tokenizer import PRE_TOKENIZER_REGEXES, SUPPORTED_TOKENIZER_MODELS, build_gguf_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "It's a dog's life; they're here, we've gone, I'm sure you'll see, he'd go. IT'S LOUD.",
    "CamelCaseWords and snake_case_words and SHOUTING",
    "Don't stop—keep going… (really) [maybe] {never}",
    "“Curly quotes” and ‘single’ ones, «guillemets»",
    "What is the capital of France? The capital of France is Paris.",
]
CODE = [
    "def square(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "SELECT name FROM users WHERE id = 42;",
    '<div class="x">&amp;&lt;</div>',
    "x <<= 3; y >>= 2; z != w && a || b; c ?? d",
    '#include <stdio.h>\nint main(void) { printf("%d\\n", 1); }',
    "\tindented with a tab\n        and with spaces\n",
]
NUMBERS = [
    "0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159265358979", "1,000,000", "-273.15",
    "1e-10", "0x1F", "2024-01-31", "12:34:56", "99999999999999999999999", "٣٤٥", "１２３", "½ ² ⅷ",
]  # fmt: skip
WHITESPACE = [
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", " \n ", "\t \n", "    ", " " * 17,
    "\u00a0", "\u3000", "\u2009", "\r", "\x0b\x0c",
]  # fmt: skip
UNICODE = [
    "café naïve Ångström señor Zürich garçon",
    "日本語のテキストです。",
    "中文字符测试，标点！",
    "한국어 텍스트",
    "مرحبا بالعالم",
    "שלום עולם",
    "Привет, мир",
    "नमस्ते दुनिया",
    "ελληνικά γράμματα",
    "🙂🚀",
    "👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈",
    "👍🏽👋🏿",
    "e\u0301 a\u0308 n\u0303 combining",
    "Z\u0351\u0352a\u0353l\u0354g\u0355o",
    "\ufeffBOM and \u200bzero width",
    "ﬁ ligature and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\x00\x01\x7f control bytes",
]
SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>",
    "<|im_end|>\n",
    "<|endoftext|>",
    "text<|endoftext|>more",
    " <|im_end|> ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start",
    "im_end|>",
    "<|IM_START|>",
    "<repo_name>x<file_sep>y",
    "<think>reasoning</think>",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour 🙂"},
        {"role": "assistant", "content": "Salut, ça va ?"},
        {"role": "user", "content": "  Très bien.\n\n"},
    ],
]


def _texts() -> list[str]:
    """A few hundred strings, the same on every run."""
    fragments = PROSE + CODE + NUMBERS + WHITESPACE + UNICODE + SPECIAL
    texts = [""] + fragments
    for fragment in PROSE + UNICODE + CODE[:3]:
        texts += [" " + fragment, fragment + " ", "\n" + fragment + "\n", "  " + fragment + "\t"]
    rng = random.Random(0)
    for _ in range(150):
        parts = rng.sample(fragments, rng.randint(2, 4))
        texts.append(rng.choice(["", " ", "\n", "  ", "\t", " \n"]).join(parts))
    return texts


TEXTS = _texts()


def _assert_same_tokenizer(ours, theirs, texts=TEXTS):
    assert len(ours) == len(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id"), name
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.add_bos_token, ours.add_eos_token) == (theirs.add_bos_token, theirs.add_eos_token)
    for text in texts:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), (text, add_special_tokens)
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids), text
            for skip in (True, False):
                decoded = ours.decode(ids, skip_special_tokens=skip)
                assert decoded == theirs.decode(ids, skip_special_tokens=skip), (text, skip)
    # Arbitrary id runs: split UTF-8 sequences, special tokens mid-text, ids next to each other.
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids


def _assert_same_chat_template(ours, theirs):
    assert ours.chat_template == theirs.chat_template
    for messages in CONVERSATIONS:
        for tokenize in (False, True):
            kwargs = {"tokenize": tokenize, "add_generation_prompt": True}
            assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(messages, **kwargs)


# --- the built-in SmolLM2 (byte-level BPE, tokenizer.ggml.pre = "smollm") ---------------------------------


@pytest.fixture(scope="module")
def smollm2_built_and_cached(tmp_path_factory):
    """(tokenizer built from the GGUF, the same loaded back from the on-disk cache)."""
    cache = str(tmp_path_factory.mktemp("jaxpaged_cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXPAGED_CACHE", cache)
        built = load_gguf_tokenizer(smollm2_path())
        (cached_dir,) = os.listdir(os.path.join(cache, "tokenizers"))
        assert "chat_template.jinja" in os.listdir(os.path.join(cache, "tokenizers", cached_dir))
        cached = load_gguf_tokenizer(smollm2_path())
    return built, cached


@pytest.mark.parametrize("source", ["built", "cached"])
def test_smollm2_tokenizes_like_transformers(smollm2_built_and_cached, source):
    ours = smollm2_built_and_cached[source == "cached"]
    theirs = smollm2_tokenizer()
    _assert_same_tokenizer(ours, theirs)
    _assert_same_chat_template(ours, theirs)
    assert (len(ours), ours.bos_token_id, ours.eos_token_id) == (49152, 1, 2)
    assert ours.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[0] == 1


def test_smollm2_pipeline_is_transformers_pipeline():
    """The whole `tokenizers` pipeline (vocab, merges, added tokens, pre-tokenizer, decoder) is the same."""
    ours = build_gguf_tokenizer(smollm2_path())
    theirs = smollm2_tokenizer()
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())


def test_pre_tokenizer_regexes_are_transformers_regexes():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert PRE_TOKENIZER_REGEXES == GGUF_PRE_TOKENIZER_SPLITS


# --- tiny GGUF vocabularies written here --------------------------------------------------------------------


def _write_gguf(path, model, tokens, token_types, *, scores=None, merges=None, pre=None, special_ids=None,
                add_bos=None, add_eos=None, chat_template=None) -> str:  # fmt: skip
    """A vocabulary-only llama GGUF; transformers wants a model config and a tensor beside it."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2),
                       ("attention.head_count_kv", 2), ("vocab_size", len(tokens))]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    for name, token_id in (special_ids or {}).items():
        getattr(writer, f"add_{name}_token_id")(token_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _transformers_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def smollm2_vocab():
    """SmolLM2's first 3000 tokens and the merges among them: a real byte-level vocabulary, small."""
    reader = gguf.GGUFReader(smollm2_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:3000]
    types = reader.fields["tokenizer.ggml.token_type"].contents()[:3000]
    kept = set(tokens)
    merges = []
    for merge in reader.fields["tokenizer.ggml.merges"].contents():
        left, right = merge.split(" ")
        if left in kept and right in kept and left + right in kept:
            merges.append(merge)
    return tokens, types, merges


@pytest.mark.parametrize(
    "pre, endoftext",
    [("smollm", True), ("llama-bpe", False), ("qwen2", True), ("qwen35", True), ("tekken", True), ("gpt-4o", True)],
)
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, smollm2_vocab, pre, endoftext):
    tokens, types, merges = smollm2_vocab
    tokens, types = list(tokens), list(types)
    if not endoftext:  # like Llama 3: transformers then appends "<|endoftext|>" as a new id
        tokens[0] = "<|end_of_text|>"
    # A user-defined token, and a control token spelled outside the byte alphabet (skipped).
    tokens += ["<think>", "</think>", "<｜end▁of▁sentence｜>"]
    types += [4, 4, 3]
    path = _write_gguf(
        str(tmp_path / f"{pre}.gguf"), "gpt2", tokens, types, merges=merges, pre=pre,
        special_ids={"bos": 1, "eos": 2, "pad": 2}, add_bos=False, chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    ours, theirs = build_gguf_tokenizer(path), _transformers_tokenizer(path)
    _assert_same_tokenizer(ours, theirs)
    _assert_same_chat_template(ours, theirs)
    assert ours.encode("<think>", add_special_tokens=False) == [len(tokens) - 3]


def _sentencepiece_vocab():
    """A Llama-2-style vocabulary: <unk> <s> </s>, 256 byte tokens, then "▁"-spelled pieces whose
    scores tie often, so the rebuilt merge order depends on every tie-break."""
    rng = random.Random(2)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    types = [2, 3, 3] + [6] * 256
    corpus = " ".join(PROSE + CODE + NUMBERS[:12] + UNICODE[:1])
    pieces = dict.fromkeys(ch for ch in corpus.replace(" ", "▁") if not ch.isspace())
    for word in re.findall(r"\w+|[^\w\s]+", corpus):
        spelled = "▁" + word
        for start in range(len(spelled)):
            for end in range(start + 2, min(len(spelled), start + 6) + 1):
                pieces.setdefault(spelled[start:end])
    pieces = [p for p in pieces if p not in tokens]
    tokens += pieces + ["<|im_start|>", "<|im_end|>", "<think>"]
    types += [1] * len(pieces) + [3, 3, 4]
    scores = [0.0] * 259 + [-float(rng.randrange(40)) for _ in pieces] + [0.0, 0.0, 0.0]
    return tokens, types, scores


@pytest.mark.parametrize("add_bos, add_eos", [(None, None), (False, True)])
def test_sentencepiece_vocabulary_matches_transformers(tmp_path, add_bos, add_eos):
    tokens, types, scores = _sentencepiece_vocab()
    path = _write_gguf(
        str(tmp_path / "spm.gguf"), "llama", tokens, types, scores=scores, pre="default",
        special_ids={"bos": 1, "eos": 2, "unk": 0}, add_bos=add_bos, add_eos=add_eos, chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    ours, theirs = build_gguf_tokenizer(path), _transformers_tokenizer(path)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    _assert_same_tokenizer(ours, theirs)
    _assert_same_chat_template(ours, theirs)
    ids = ours.encode("hi")
    if add_bos is None:  # llama.cpp's default for a SentencePiece vocabulary: BOS, no EOS
        assert ids[0] == 1 and ids[-1] != 2
    else:
        assert ids[0] != 1 and ids[-1] == 2


@pytest.fixture(scope="module")
def unigram_gguf(tmp_path_factory):
    """A T5-style (unigram) vocabulary: not built here, only by transformers."""
    tokens = ["<pad>", "</s>", "<unk>"] + ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab"]
    path = str(tmp_path_factory.mktemp("gguf") / "t5.gguf")
    return _write_gguf(
        path, "t5", tokens, [3, 3, 2] + [1] * 7, scores=[0.0, 0.0, 0.0, -2.0, -3.0, -3.0, -1.5, -1.5, -2.5, -1.0],
        special_ids={"eos": 1, "unk": 2, "pad": 0},
    )  # fmt: skip


def test_other_tokenizer_models_fall_back_to_transformers_when_torch_is_there(unigram_gguf):
    ours, theirs = build_gguf_tokenizer(unigram_gguf), _transformers_tokenizer(unigram_gguf)
    for text in ("ab ab a b", "ba", ""):
        assert ours.encode(text) == theirs.encode(text)


# --- no torch at run time -----------------------------------------------------------------------------------

_WITHOUT_TORCH = textwrap.dedent(
    """
    import importlib.machinery, json, sys

    class PathFinderWithoutTorch:
        '''Stands in for the path finder and finds everything it finds but torch: to importlib
        and transformers torch looks uninstalled, and `import torch` raises ModuleNotFoundError.'''

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "torch":
                return None
            return importlib.machinery.PathFinder.find_spec(name, path, target)

        def invalidate_caches(self):
            importlib.machinery.PathFinder.invalidate_caches()

        def find_distributions(self, *args, **kwargs):  # importlib.metadata asks the path finder too
            return importlib.machinery.PathFinder.find_distributions(*args, **kwargs)

    sys.meta_path[:] = [PathFinderWithoutTorch() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    try:
        import torch
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("torch is still importable")

    from jaxpaged.models.builtin import builtin_model_path
    from jaxpaged.models.gguf_loader import load_gguf_tokenizer

    texts, unsupported = json.loads(sys.argv[1]), sys.argv[2]
    runs = []
    for _ in ("built", "cached"):
        tokenizer = load_gguf_tokenizer(builtin_model_path())
        ids = [tokenizer.encode(text) for text in texts]
        runs.append({"ids": ids, "decoded": [tokenizer.decode(i) for i in ids]})
    try:
        load_gguf_tokenizer(unsupported)
        error = None
    except ValueError as err:
        error = str(err)
    print(json.dumps({"runs": runs, "error": error, "torch_imported": "torch" in sys.modules}))
    """
)


def test_tokenizer_builds_and_loads_without_torch(tmp_path, unigram_gguf):
    texts = TEXTS[:60]
    env = dict(os.environ, JAXPAGED_CACHE=str(tmp_path), PYTHONPATH=REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, json.dumps(texts), unigram_gguf],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not report["torch_imported"]
    assert os.listdir(os.path.join(str(tmp_path), "tokenizers")), "the first load did not fill the cache"
    theirs = smollm2_tokenizer()
    expected_ids = [theirs.encode(text) for text in texts]
    for run in report["runs"]:  # built from the GGUF, then read back from the cache
        assert run["ids"] == expected_ids
        assert run["decoded"] == [theirs.decode(ids) for ids in expected_ids]
    error = report["error"]
    assert error is not None and "tokenizer.ggml.model='t5'" in error
    assert all(repr(model) in error for model in SUPPORTED_TOKENIZER_MODELS)


def test_detokenizer_streams_our_tokenizer_like_transformers_decodes(smollm2_built_and_cached):
    from jaxpaged.engine.detokenizer import IncrementalDetokenizer, decode_ids

    ours, theirs = smollm2_built_and_cached[0], smollm2_tokenizer()
    prompt = ours.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=False)
    prompt_ids = ours.encode(prompt)
    for text in ["你好！😀 Hello 👍🏽, naïve café — 中文和English混合.<|im_end|>", *UNICODE, *CODE]:
        output_ids = theirs.encode(text)
        detokenizer = IncrementalDetokenizer(ours, prompt_ids)
        streamed = "".join(detokenizer.add_tokens([token_id]) for token_id in output_ids)
        assert streamed == detokenizer.output_text == theirs.decode(output_ids, skip_special_tokens=True), text
        assert decode_ids(ours, output_ids) == theirs.decode(output_ids, skip_special_tokens=True)
