"""vLLM's continue_final_message (LLM.chat, /v1/chat/completions, /tokenize): the conversation's last message
is left open for the model to continue (an answer prefilled), instead of a new turn's generation prompt."""

import httpx
import pytest

from jaxpaged import AsyncLLM, SamplingParams
from jaxpaged.server import build_app
from tests.engine.test_llm_generate import tiny_llm
from tests.server.helpers import MODEL, serving
from tests.server.test_async_llm import tiny_engine_args
from tests.tiny_models import tiny_tokenizer

PREFILLED = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "The capital is"}]
OPEN = "user: Hello\nassistant: The capital is"   # the tiny template, its last turn left open
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_llm_chat_continues_the_last_message():
    llm = tiny_llm()
    out = llm.chat(PREFILLED, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == OPEN
    ids = tiny_tokenizer().encode(OPEN, add_special_tokens=False)
    assert out.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, GREEDY,
                                                    use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(PREFILLED, GREEDY, use_tqdm=False, continue_final_message=True)   # add_generation_prompt=True
    with pytest.raises(ValueError, match="final message has no"):   # nothing to continue
        llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant"}], GREEDY, use_tqdm=False,
                 add_generation_prompt=False, continue_final_message=True)


@pytest.fixture(scope="module")
def url():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    try:
        with serving(build_app(engine, [MODEL])) as (url,):
            yield url
    finally:
        engine.shutdown()


def chat(url: str, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": PREFILLED, "max_tokens": 5,
                                                          "temperature": 0, "ignore_eos": True, **fields}, timeout=60)


def test_chat_completions_continue_the_last_message(url):
    ids = tiny_tokenizer().encode(OPEN, add_special_tokens=False)
    plain = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 5,
                                                      "temperature": 0, "ignore_eos": True}).json()
    for fields in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        answer = chat(url, **fields)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
        assert answer.json()["usage"]["prompt_tokens"] == len(ids)
    tokens = httpx.post(url + "/tokenize", json={"messages": PREFILLED, "continue_final_message": True}).json()
    assert tokens["tokens"] == ids
    both = chat(url, continue_final_message=True, add_generation_prompt=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_chat_echo_puts_the_continued_message_before_the_answer(url):
    """vLLM's chat `echo`: the answer begins with the last message's content when the answer continues it (or
    it is the assistant's), in a whole response and in a stream's first chunk; a user's last message is not
    echoed before a new assistant turn."""
    import json
    plain = chat(url, continue_final_message=True).json()["choices"][0]["message"]["content"]
    echoed = chat(url, continue_final_message=True, echo=True)
    assert echoed.status_code == 200, echoed.text
    assert echoed.json()["choices"][0]["message"]["content"] == "The capital is" + plain
    assert echoed.json()["usage"]["completion_tokens"] == 5   # the echoed text is not generated
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": PREFILLED, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "echo": True, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"].startswith("The capital is")
    assert "".join(d.get("content") or "" for d in deltas) == "The capital is" + plain
    question = [{"role": "user", "content": "Hello"}]
    fresh = chat(url, messages=question).json()["choices"][0]["message"]["content"]
    assert chat(url, messages=question, echo=True).json()["choices"][0]["message"]["content"] == fresh
