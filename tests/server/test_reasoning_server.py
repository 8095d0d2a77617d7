"""--reasoning-parser over HTTP: a chat answer's <think> text comes back as `reasoning` (and
`reasoning_content`), whole and streamed (the deltas reassemble to the whole), before tool calls are read;
chat_template_kwargs reach the template and turn Qwen3's thinking off; include_reasoning false drops it.
The tiny random model is held to the shape of a thinking answer by a regex."""

import json

import openai
import pytest

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app
from jaxpaged.server.tools import ToolSettings
from tests.server.helpers import HTTP, MODEL, serving
from tests.server.test_async_llm import tiny_engine_args
from tests.server.test_tool_calls import TOOLS

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            "{% if m.get('reasoning_content') %} [thought: {{ m['reasoning_content'] }}]{% endif %}\n{% endfor %}"
            "assistant:{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
THINKING = r"<think>[a-z]{2,6} [a-z]{2,6}</think>[A-Z][a-z]{2,8}\."
ASK = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def url():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(max_model_len=512), use_tqdm=False)
    settings = ToolSettings(True, "hermes", "qwen3")
    with serving(build_app(engine, [MODEL], tool_settings=settings, chat_template=TEMPLATE)) as urls:
        yield urls[0]
    engine.shutdown()


def chat(url: str, **body) -> dict:
    reply = HTTP.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 40, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_reasoning_comes_apart_from_the_answer_whole_and_streamed(url):
    body = {"structured_outputs": {"regex": THINKING}, "temperature": 1.0, "seed": 3}
    message = chat(url, **body)["choices"][0]["message"]
    thought, answer = message["reasoning"], message["content"]
    assert message["reasoning_content"] == thought and " " in thought and "<think>" not in thought
    assert answer[0].isupper() and answer.endswith(".") and "</think>" not in answer
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, stream=True, extra_body=body,
                                            temperature=1.0, seed=3)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    hidden = chat(url, include_reasoning=False, **body)["choices"][0]["message"]
    assert hidden["content"] == answer and "reasoning" not in hidden


def test_chat_template_kwargs_reach_the_template_and_turn_thinking_off(url):
    ids = HTTP.post(url + "/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}})
    text = HTTP.post(url + "/detokenize", json={"tokens": ids.json()["tokens"]}).json()["prompt"]
    assert text.endswith("assistant:<think></think>")
    off = {"structured_outputs": {"regex": r"[a-z]{2,6} ok\."}, "chat_template_kwargs": {"enable_thinking": False}}
    message = chat(url, **off)["choices"][0]["message"]
    assert message["content"].endswith(" ok.") and "reasoning" not in message
    history = ASK + [{"role": "assistant", "content": "Hi.", "reasoning_content": "greet back"},
                     {"role": "user", "content": "And?"}]
    ids = HTTP.post(url + "/tokenize", json={"messages": history}).json()["tokens"]
    assert "[thought: greet back]" in HTTP.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    clash = HTTP.post(url + "/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": {"tokenize": True}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"


def test_tool_calls_are_read_in_the_answer_after_the_reasoning(url):
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
    body = {"structured_outputs": {"regex": r"<think>[a-z]{2,6}</think>" + call}, "tools": TOOLS, "max_tokens": 200,
            "seed": 5}
    message = chat(url, **body)["choices"][0]["message"]
    assert message["reasoning"] and message["tool_calls"][0]["function"]["name"] == "get_time"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}
    reply = HTTP.post(url + "/v1/chat/completions", json={"messages": ASK, "stream": True, **body})
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_time" and not any(d.get("content") for d in deltas)
