"""gpt-oss over HTTP: its harmony answer comes back as `reasoning` (the analysis channel), `content` (the final
channel) and tool calls (`--tool-call-parser openai`), whole and streamed, with no parser named (gpt-oss'
default) and whatever skip_special_tokens says; reasoning_effort and an earlier turn's reasoning reach the
template, on /v1/chat/completions and /v1/responses.

The tiny random gpt-oss does not know harmony: a Lark grammar (whose <|...|> are the special tokens) makes it
write one. Structured outputs wait for the final channel with this parser, so the test's engine lets them
constrain from the first token instead (its grammar compiler is told of no reasoning tags)."""

import json

import pytest

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app
from jaxpaged.server.tools import ToolSettings
from tests.server.helpers import HTTP, MODEL, serving
from tests.server.test_async_llm import tiny_engine_args
from tests.server.test_tool_calls import TOOLS
from tests.test_harmony import gpt_oss_checkpoint

# gpt-oss' template, shortened: the effort in the system message, the tools' names, earlier turns' reasoning
# (`thinking`) and calls
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort if reasoning_effort is defined else 'medium' }}<|end|>"
    "{% if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t.function.name }};{% endfor %}<|end|>"
    "{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{% for c in m.tool_calls or [] %}<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json"
    "<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THINK = '<|channel|> "analysis" <|message|> /[a-z]{3,8}/ <|end|> <|start|> "assistant" <|channel|> '
ANSWER = {"grammar": f'start: {THINK} "final" <|message|> /[A-Z][a-z]{{2,6}}\\./'}
CALL = {"grammar": f'start: {THINK} "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
                   '"{\\"city\\": \\"Paris\\"}"'}


@pytest.fixture(scope="module")
def url():
    args = tiny_engine_args(model=gpt_oss_checkpoint(), max_model_len=512)
    engine = AsyncLLM.from_engine_args(args, use_tqdm=False)
    assert engine.args.reasoning_parser == "openai_gptoss"   # gpt-oss' default, as vLLM's
    engine.engine.grammars.reasoning_tags = None   # the grammar writes the reasoning too (see above)
    app = build_app(engine, [MODEL], tool_settings=ToolSettings(True, "openai"), chat_template=TEMPLATE)
    with serving(app) as urls:
        yield urls[0]
    engine.shutdown()


def post(url: str, route: str = "/v1/chat/completions", **body):
    reply = HTTP.post(url + route, json={"messages": ASK, "max_tokens": 120, "temperature": 1.0, "seed": 7, **body})
    assert reply.status_code == 200, reply.text
    return reply


def deltas(url: str, **body) -> list[dict]:
    lines = post(url, stream=True, **body).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [None, True])
def test_the_analysis_is_reasoning_and_the_final_channel_is_content(url, skip_special_tokens):
    body = {"structured_outputs": ANSWER, "skip_special_tokens": skip_special_tokens}
    choice = post(url, **body).json()["choices"][0]
    message = choice["message"]
    assert message["reasoning"].isalpha() and message["reasoning"] == message["reasoning_content"]
    assert message["content"][0].isupper() and message["content"].endswith(".") and choice["finish_reason"] == "stop"
    streamed = deltas(url, **body)
    assert joined(streamed, "reasoning") == message["reasoning"] and joined(streamed, "content") == message["content"]


def test_a_call_to_a_function_is_a_tool_call_whole_and_streamed(url):
    body = {"structured_outputs": CALL, "tools": TOOLS}
    choice = post(url, **body).json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None and message["reasoning"].isalpha()
    call, = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    streamed = deltas(url, **body)
    calls = [t for d in streamed for t in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(t["function"].get("arguments", "") for t in calls) == call["function"]["arguments"]
    assert joined(streamed, "reasoning") == message["reasoning"] and not joined(streamed, "content")


def test_reasoning_effort_and_earlier_reasoning_reach_the_template(url):
    history = ASK + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "look it up"},
                     {"role": "user", "content": "And Rome?"}]

    def prompt(reply: dict) -> str:
        return HTTP.post(url + "/detokenize", json={"tokens": reply["prompt_token_ids"]}).json()["prompt"]

    chat = post(url, messages=history, max_tokens=1, reasoning_effort="low", return_token_ids=True).json()
    assert "Reasoning: low" in prompt(chat) and "<|channel|>analysis<|message|>look it up<|end|>" in prompt(chat)
    assert "Reasoning: medium" in prompt(post(url, max_tokens=1, return_token_ids=True).json())
    bad = HTTP.post(url + "/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "extreme"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    response = HTTP.post(url + "/v1/responses", json={"input": "Hi", "reasoning": {"effort": "high", "summary": "auto"},
                                                       "max_output_tokens": 120, "structured_outputs": ANSWER}).json()
    assert response["reasoning"] == {"effort": "high", "summary": "auto"}
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "message"] and response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
