"""--reasoning-parser over HTTP: a chat answer's <think> text comes back as `reasoning` (and
`reasoning_content`), whole and streamed (the deltas reassemble to the whole), before tool calls are read;
structured outputs constrain what follows </think> (from the start when the template turned thinking
off); chat_template_kwargs reach the template; include_reasoning false drops the reasoning.

The tiny random model gets a tokenizer where <think> and </think> are tokens (as in Qwen3's), and logit
biases that make it think in "a"s until it writes </think>."""

import functools
import json
import os
import re
import shutil

import openai
import pytest

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app
from jaxpaged.server.tools import ToolSettings
from tests.server.helpers import HTTP, MODEL, serving
from tests.server.test_async_llm import tiny_engine_args
from tests.server.test_tool_calls import TOOLS
from tests.tiny_models import scratch_folder, tiny_checkpoint, tiny_tokenizer

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            "{% if m.get('reasoning_content') %} [thought: {{ m['reasoning_content'] }}]{% endif %}\n{% endfor %}"
            "assistant:{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
ASK = [{"role": "user", "content": "Hello"}]


@functools.cache
def thinker() -> str:
    """The tiny llama (a vocabulary of 336) with <think> = 320 and </think> = 321 in its tokenizer."""
    import tokenizers

    folder = os.path.join(scratch_folder("thinker-"), "model")
    shutil.copytree(tiny_checkpoint("llama", vocab_size=336), folder)
    tokenizer = tiny_tokenizer()
    tokenizer = type(tokenizer)(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
                                pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.add_tokens(["<think>", "</think>"])
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [320, 321]
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def url():
    args = tiny_engine_args(model=thinker(), max_model_len=512, reasoning_parser="qwen3")
    engine = AsyncLLM.from_engine_args(args, use_tqdm=False)
    app = build_app(engine, [MODEL], tool_settings=ToolSettings(True, "hermes"), chat_template=TEMPLATE)
    with serving(app) as urls:
        yield urls[0]
    engine.shutdown()


def thinking(url: str) -> dict:
    """Greedy sampling that thinks in "a"s until their growing frequency penalty lets </think> win."""
    a = HTTP.post(url + "/tokenize", json={"prompt": "a", "add_special_tokens": False}).json()["tokens"]
    return {"logit_bias": {str(a[0]): 10, "321": 8}, "frequency_penalty": 1.0, "temperature": 0.0}


def chat(url: str, **body) -> dict:
    reply = HTTP.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 60, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_reasoning_comes_apart_from_a_constrained_answer_whole_and_streamed(url):
    body = {**thinking(url), "structured_outputs": {"regex": r"[A-Z][a-z]{2,6}\."}}
    message = chat(url, **body)["choices"][0]["message"]
    thought, answer = message["reasoning"], message["content"]
    assert message["reasoning_content"] == thought and set(thought) == {"a"}   # free until </think>
    assert answer[0].isupper() and answer.endswith(".") and answer[1:-1].islower()   # then the regex's
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, stream=True, extra_body=body)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    hidden = chat(url, include_reasoning=False, **body)["choices"][0]["message"]
    assert hidden["content"] == answer and "reasoning" not in hidden


def test_with_thinking_off_the_template_closes_it_and_the_constraint_holds_from_the_start(url):
    ids = HTTP.post(url + "/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}})
    assert ids.json()["tokens"][-2:] == [320, 321]   # ... assistant:<think></think>
    off = {**thinking(url), "structured_outputs": {"regex": r"[a-z]{2,6} ok\."},
           "chat_template_kwargs": {"enable_thinking": False}}
    message = chat(url, **off)["choices"][0]["message"]
    assert re.fullmatch(r"[a-z]{2,6} ok\.", message["content"]) and "reasoning" not in message   # no </think>
    history = ASK + [{"role": "assistant", "content": "Hi.", "reasoning_content": "greet back"},
                     {"role": "user", "content": "And?"}]
    ids = HTTP.post(url + "/tokenize", json={"messages": history}).json()["tokens"]
    assert "[thought: greet back]" in HTTP.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    clash = HTTP.post(url + "/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": {"tokenize": True}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"


def test_tool_calls_are_read_in_the_answer_after_the_reasoning(url):
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
    body = {**thinking(url), "structured_outputs": {"regex": call}, "tools": TOOLS, "max_tokens": 200}
    message = chat(url, **body)["choices"][0]["message"]
    assert set(message["reasoning"]) == {"a"} and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_time"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}
    reply = HTTP.post(url + "/v1/chat/completions", json={"messages": ASK, "stream": True, **body})
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_time" and not any(d.get("content") for d in deltas)
