"""gpt-oss' harmony format read back (jaxpaged.harmony): reasoning from the analysis channel, content from
the final one and preambles, tool calls from messages to functions.NAME, whole and streamed in any pieces;
structured outputs wait for the final channel's header; gpt-oss checkpoints default to this parser."""

import functools
import json
import os
import random
import shutil

import pytest

from jaxpaged.harmony import HarmonyReader, speaks_harmony
from jaxpaged.reasoning import ReasoningParser
from jaxpaged.tool_parsers import get_tool_parser
from tests.test_reasoning import assert_stream_reassembles
from tests.test_tool_parsers import assert_whole_and_streamed_read_the_same
from tests.tiny_models import scratch_folder, tiny_checkpoint, tiny_tokenizer

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
CASES = [   # (output text, reasoning, content, calls)
    (f"{ANALYSIS}The user asks.{NEXT}<|channel|>final<|message|>Sunny.", "The user asks.", "Sunny.", []),
    (f"{ANALYSIS}Weather?{NEXT}{CALL}", "Weather?", None, [("get_weather", {"city": "Paris"})]),
    # the recipient in the role's part of the header, the content type without <|constrain|>
    (f'{ANALYSIS}Time.{NEXT} to=functions.get_time<|channel|>commentary json<|message|>{{"zone": "UTC"}}',
     "Time.", None, [("get_time", {"zone": "UTC"})]),
    # a preamble (commentary to nobody) is content; two calls in turn
    (f"<|channel|>commentary<|message|>Let me look.{NEXT}{CALL}<|call|>", None, "Let me look.",
     [("get_weather", {"city": "Paris"})]),
    (f"{ANALYSIS}a{NEXT}{ANALYSIS}b{NEXT}<|channel|>final<|message|>c", "a\nb", "c", []),
    ("No harmony here.", None, "No harmony here.", []),
    (f"{ANALYSIS}cut short by max_tokens", "cut short by max_tokens", None, []),
    # a built-in tool's call (no built-in tools are served) is dropped; spaces between markers are not text
    (f"{ANALYSIS}x<|end|> <|start|>assistant<|channel|>analysis to=browser.search<|message|>{{}}<|end|> "
     "<|start|>assistant<|channel|>final<|message|>y<|return|>", "x", "y", []),
    ("<|start|>assistant<|channel|>final<|message|>Hi", None, "Hi", []),   # a header in full
    ("Hello<|end|><|start|>assistant<|channel|>final<|message|>Hi", None, "Hello\nHi", []),   # text, then harmony
    ("to=morrow is fine", None, "to=morrow is fine", []),   # looked like a header until the end
    ("<|channel|>final<|message|>a <|b|> c<|e", None, "a <|b|> c<|e", []),   # not markers after all
]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_whole_outputs_split_into_reasoning_content_and_calls(text, reasoning, content, calls):
    assert ReasoningParser("openai_gptoss").extract(text) == (reasoning, content)
    read_as = content if calls else content or ""   # without calls the reader's content is a string
    assert_whole_and_streamed_read_the_same(lambda: get_tool_parser("openai")(), text, read_as, calls)


@pytest.mark.parametrize("seed", range(12))
def test_a_stream_in_random_pieces_reassembles_to_the_whole(seed):
    rng = random.Random(seed)
    text = CASES[rng.randrange(len(CASES))][0]
    cuts = sorted(rng.sample(range(1, len(text)), min(10, len(text) - 1)))
    assert_stream_reassembles("openai_gptoss", [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])


def test_arguments_stream_as_they_are_written_and_a_partial_marker_waits():
    reader = get_tool_parser("openai")()
    head = f"{ANALYSIS}Hm.{NEXT}<|channel|>commentary to=functions.get_weather json<|message|>"
    assert reader.feed(head[:-4], done=False) == []   # the header is not whole yet
    first, = reader.feed(head + '{"ci', done=False)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert reader.feed(head + '{"city": "Rome"}<|ca', done=False) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]}]   # "<|ca" may be <|call|>
    stream = ReasoningParser("openai_gptoss").stream()
    assert stream.feed(f"{ANALYSIS}Think<|e", done=False) == ("Think", "")
    assert stream.feed("nd|><|start|>assistant<|channel|>final<|message|>Go", done=False) == ("", "Go")


def test_messages_carry_channel_recipient_and_content_type_and_the_reader_keeps_only_the_unsettled_text():
    reader = HarmonyReader()
    events = reader.push(f"{ANALYSIS}x{NEXT}{CALL}", done=True)
    first, second = reader.messages
    assert (first.channel, first.recipient, first.kind) == ("analysis", None, "reasoning")
    assert (second.channel, second.recipient, second.content_type, second.function) == \
        ("commentary", "functions.get_weather", "json", "get_weather")
    assert events == [(0, None), (0, "x"), (1, None), (1, '{"city": "Paris"}')]
    long = HarmonyReader()
    long.push(ANALYSIS, done=False)
    for _ in range(2000):   # only a tail that may still become a marker waits: nothing is read twice
        long.push("word <|", done=False)
        assert long._buffer == "<|"


def test_forced_calls_are_read_in_the_final_channel_without_preambles():
    from jaxpaged.tool_parsers import RequiredReader

    stream = ReasoningParser("openai_gptoss").stream()
    stream.feed(f"{ANALYSIS}Hm.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.{NEXT}"
                '<|channel|>final<|message|>[{"name": "get_weather", "parameters": {"city": "Paris"}}]', done=True)
    assert stream.answer.startswith("Checking.\n[")   # the preamble is content
    call, = RequiredReader().extract(stream.final).tool_calls   # the final channel is what the grammar wrote
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


@functools.cache
def harmony_tokenizer():
    """The tiny tokenizer with harmony's markers as special tokens 320-326, <|return|> its EOS."""
    import tokenizers

    base = tiny_tokenizer()
    tokenizer = type(base)(tokenizer_object=tokenizers.Tokenizer.from_str(base.backend_tokenizer.to_str()),
                           pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.eos_token = "<|return|>"
    assert tokenizer.convert_tokens_to_ids(MARKERS) == list(range(320, 327))
    return tokenizer


@functools.cache
def gpt_oss_checkpoint() -> str:
    """A tiny random gpt-oss (a vocabulary of 336; plain rope over 1024 positions) with the harmony tokenizer."""
    folder = os.path.join(scratch_folder("harmony-"), "model")
    model = tiny_checkpoint("gpt_oss", vocab_size=336, rope_parameters=None, max_position_embeddings=1024)
    shutil.copytree(model, folder)
    harmony_tokenizer().save_pretrained(folder)
    return folder


def test_only_a_tokenizer_with_the_markers_speaks_harmony():
    assert speaks_harmony(harmony_tokenizer()) and not speaks_harmony(tiny_tokenizer())


def test_a_constraint_waits_for_the_final_channel_unless_the_prompt_opened_it():
    from jaxpaged.runner.structured_outputs import AfterReasoning, GrammarCompiler
    from jaxpaged.sampling_params import StructuredOutputsParams

    tokenizer = harmony_tokenizer()
    compiler = GrammarCompiler(tokenizer, 336, "openai_gptoss")
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    params = StructuredOutputsParams(regex="[a-z]+")
    history = encode("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello<|end|>"
                     "<|start|>user<|message|>And?<|end|>")
    waits = compiler.matcher(params, history + encode("<|start|>assistant"))   # an earlier answer ended nothing
    assert isinstance(waits, AfterReasoning) and waits.end_ids == encode("<|channel|>final<|message|>")
    for token in encode(f"{ANALYSIS}THINK 1<|end|><|start|>assistant<|channel|>final<|message|>"):
        assert waits.consume_token(token)
    assert waits.active and not waits.consume_token(encode("X")[0])   # then the regex holds
    answering = compiler.matcher(params, history + encode("<|start|>assistant<|channel|>final<|message|>"))
    assert not isinstance(answering, AfterReasoning)


def test_a_gpt_oss_checkpoint_defaults_to_harmony_and_other_models_to_none():
    from jaxpaged import LLM, SamplingParams

    engine = dict(dtype="float32", block_size=8, max_model_len=64, num_gpu_blocks_override=16,
                  compile_on_startup=False)
    llm = LLM(gpt_oss_checkpoint(), **engine)
    assert llm.llm_engine.args.reasoning_parser == "openai_gptoss"
    plain = LLM(tiny_checkpoint("gpt_oss"), **engine)
    assert plain.llm_engine.args.reasoning_parser is None   # its tokenizer has no harmony markers
    explicit = LLM(gpt_oss_checkpoint(), reasoning_parser="qwen3", **engine)
    assert explicit.llm_engine.args.reasoning_parser == "qwen3"   # a parser given is kept
    out = llm.generate("<|start|>user<|message|>Hi<|end|><|start|>assistant",
                       SamplingParams(max_tokens=4, temperature=0.0, skip_special_tokens=False), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
