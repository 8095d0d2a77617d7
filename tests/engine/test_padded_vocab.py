"""A model with more embedding rows than its tokenizer has tokens (Qwen2.5: 151,936 rows for
151,665 tokens). Ids in the padding can be sampled and can rank among the top logprobs; they
must never break a request, and read as "" (vLLM's behaviour) in text and in logprobs.

The checkpoint here makes that happen often: its 320-token tokenizer sits on a 640-row
untied head whose rows 320..639 copy rows 0..319, so every real token has a padding twin
with the very same logit. Half of the sampled tokens are padding, and the top-k candidates
of every position come in (real, padding) pairs.
"""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from starlette.testclient import TestClient

from jaxpaged import LLM, AsyncLLM, BeamSearchParams, SamplingParams
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.server import build_app
from tests.tiny_models import tiny_checkpoint

NUM_TOKENS, NUM_ROWS = 320, 640
SEEDS = (0, 1, 2, 3)
ENGINE = dict(dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=64, max_num_seqs=4,
              compile_on_startup=False)


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("padded") / "llama"
    shutil.copytree(tiny_checkpoint("llama", vocab_size=NUM_ROWS, tie_word_embeddings=False), path)
    tensors = load_file(path / "model.safetensors")
    head = tensors["lm_head.weight"]   # [NUM_ROWS, hidden]
    head[NUM_TOKENS:] = head[:NUM_TOKENS]
    save_file(tensors, path / "model.safetensors")
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(path)) == NUM_TOKENS
    assert json.loads((path / "config.json").read_text())["vocab_size"] == NUM_ROWS
    return str(path)


@pytest.fixture(scope="module")
def llm(padded_model) -> LLM:
    return LLM(padded_model, use_tqdm=False, **ENGINE)


def in_vocab_text(tokenizer, ids) -> str:
    return tokenizer.decode([i for i in ids if i < NUM_TOKENS], skip_special_tokens=True)


def test_generate_with_padding_ids_sampled_and_in_logprobs(llm):
    tokenizer = llm.get_tokenizer()
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True, logprobs=20,
                             prompt_logprobs=20) for seed in SEEDS]
    outputs = llm.generate(["The capital of France is"] * len(SEEDS), params, use_tqdm=False)
    sampled_padding = candidate_padding = 0
    for out in outputs:
        completion = out.outputs[0]
        sampled_padding += sum(i >= NUM_TOKENS for i in completion.token_ids)
        assert completion.text == in_vocab_text(tokenizer, completion.token_ids)
        for entry in completion.logprobs + out.prompt_logprobs[1:]:
            for token_id, lp in entry.items():
                if token_id >= NUM_TOKENS:
                    candidate_padding += 1
                    assert lp.decoded_token == ""
                else:
                    assert lp.decoded_token == tokenizer.convert_tokens_to_string(
                        [tokenizer.convert_ids_to_tokens(token_id)])
    assert sampled_padding > 0 and candidate_padding > 0   # or the test proves nothing


def test_stop_string_still_found_around_padding_ids(llm):
    tokenizer = llm.get_tokenizer()
    free = llm.generate(["Hello world"], SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert any(i >= NUM_TOKENS for i in free.token_ids)
    stop = free.text.strip()[:2]
    assert stop, "the sample needs some text to stop on"
    stopped = llm.generate(["Hello world"], SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True,
                                                           stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[:free.text.index(stop)]
    assert in_vocab_text(tokenizer, stopped.token_ids).startswith(stopped.text)


def test_beam_search_through_padding_ids(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("The capital of France is")
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6))[0]
    generated = [seq.tokens[len(prompt):] for seq in out.sequences]
    assert any(i >= NUM_TOKENS for ids in generated for i in ids)
    for seq, ids in zip(out.sequences, generated):
        assert seq.text == in_vocab_text(tokenizer, ids)


@pytest.fixture(scope="module")
def client(padded_model):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=padded_model, **ENGINE), use_tqdm=False)
    with TestClient(build_app(engine, ["padded"])) as client:
        yield client
    engine.shutdown()


def _events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert not [e for e in events if "error" in e]
    return events


def _chat_tokens(logprobs: dict) -> list[str]:
    texts = []
    for item in logprobs["content"]:
        texts += [item["token"]] + [top["token"] for top in item["top_logprobs"]]
        for piece in [item, *item["top_logprobs"]]:
            assert piece["bytes"] == list(piece["token"].encode())
    return texts


def test_server_completions_with_logprobs_and_echo(client):
    # A padding id reads as "": no real token of this tokenizer does, so "" means a padding id.
    sampled, candidates = [], []
    for seed in SEEDS:
        body = {"model": "padded", "prompt": "The capital of", "max_tokens": 12, "temperature": 1.0, "seed": seed,
                "logprobs": 5, "echo": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        lps = response.json()["choices"][0]["logprobs"]
        sampled += lps["tokens"]
        candidates += [text for top in lps["top_logprobs"] if top for text in top]
        streamed = _events(client.post("/v1/completions", json={**body, "stream": True}))
        for event in streamed:
            for choice in event["choices"]:
                if choice["logprobs"]:
                    sampled += choice["logprobs"]["tokens"]
    assert "" in sampled and "" in candidates


def test_server_chat_with_top_logprobs(client):
    texts = []
    for seed in SEEDS:
        body = {"model": "padded", "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 12,
                "temperature": 1.0, "seed": seed, "logprobs": True, "top_logprobs": 5}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        texts += _chat_tokens(response.json()["choices"][0]["logprobs"])
        for event in _events(client.post("/v1/chat/completions", json={**body, "stream": True})):
            for choice in event["choices"]:
                if choice.get("logprobs"):
                    texts += _chat_tokens(choice["logprobs"])
    assert "" in texts
