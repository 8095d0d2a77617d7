"""Images in chat completions (OpenAI's image_url parts, data URLs and http; vLLM's image_embeds parts): a LLaVA
server answers with the tokens LLM.chat gives; a bad image, or an image sent to a text-only model, is a 400 naming
messages, and the server serves on."""

import http.server
import threading

import httpx
import numpy as np
import pytest

from jaxpaged import AsyncLLM, SamplingParams
from jaxpaged.server import build_app
from tests.engine.test_images import GREEDY, data_url, engine, image, llava
from tests.server.helpers import MODEL, serving
from tests.server.test_async_llm import tiny_engine_args


@pytest.fixture(scope="module")
def urls():
    path, _ = llava()
    engines = [AsyncLLM.from_engine_args(tiny_engine_args(model=path, enable_mm_embeds=True), use_tqdm=False),
               AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)]
    try:
        with serving(*(build_app(e, [MODEL]) for e in engines)) as urls:
            yield urls
    finally:
        for e in engines:
            e.shutdown()


def chat(url: str, content) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
        "messages": [{"role": "user", "content": content}]})


def png_server(body: bytes):
    """A loopback HTTP server answering every GET with `body` as image/png; (server, url)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/cat.png"


def test_chat_completions_take_image_urls(urls):
    import base64
    path, _ = llava()
    a = image(11)
    content = [{"type": "image_url", "image_url": {"url": data_url(a)}}, {"type": "text", "text": "what is it?"}]
    response = chat(urls[0], content)
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]
    ref = engine(path).chat([{"role": "user", "content": content}], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert [t["token"] for t in got["logprobs"]["content"]] == [
        ref.outputs[0].logprobs[i][t].decoded_token for i, t in enumerate(ref.outputs[0].token_ids)]
    assert response.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    server, url = png_server(base64.b64decode(data_url(a).split(",", 1)[1]))
    try:
        fetched = chat(urls[0], [{**content[0], "image_url": {"url": url}}, content[1]])
    finally:
        server.shutdown()
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["choices"][0]["message"]["content"] == got["message"]["content"]


def test_usage_tokenize_and_the_context_check_count_an_images_tokens(urls):
    """The server counts what the model sees: each image's placeholder expanded (16 tokens here), in usage, in
    /tokenize and in the context-length check of max_tokens."""
    content = [{"type": "image_url", "image_url": {"url": data_url(image(12))}}, {"type": "text", "text": "hi"}]
    messages = [{"role": "user", "content": content}]
    ids = httpx.post(urls[0] + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=60).json()["tokens"]
    assert ids.count(320) == 16
    assert chat(urls[0], content).json()["usage"]["prompt_tokens"] == len(ids)
    room = 256 - len(ids)
    too_long = httpx.post(urls[0] + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": room + 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("server, content, words", [
    (1, "IMAGE", ["messages[0].content[0] is an image", "takes text only"]),
    (0, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}], ["not an image"]),
    (0, [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}], ["data:image/ or http(s)://"]),
    (0, [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}], ["need allowed_local_media_path"]),
    (0, [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/none.png"}}], ["could not fetch"]),
    (0, [{"type": "input_audio"}], ["must be one of 'text', 'image_url'"]),
])
def test_bad_images_are_400s_naming_messages(urls, server, content, words):
    if content == "IMAGE":
        content = [{"type": "image_url", "image_url": {"url": data_url(image(1))}}]
    response = chat(urls[server], content)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and all(w in error["message"] for w in words), error["message"]
    assert chat(urls[server], "hello").status_code == 200   # the engine serves on


def torch_b64(tensor) -> str:
    import base64
    import io

    import torch
    buffer = io.BytesIO()
    torch.save(tensor.clone(), buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_image_embeds_parts_stand_for_their_images(urls):
    """vLLM's image_embeds part (--enable-mm-embeds), base64 of torch.save of transformers' get_image_features rows,
    answers as the image itself does, over HTTP and in LLM.chat (the array itself there); a part holding two images'
    rows, or sent to a text-only server or an engine without the flag, is refused naming messages."""
    import torch
    from transformers import AutoImageProcessor
    path, model = llava()
    a, b = image(11), image(12)
    pixels = AutoImageProcessor.from_pretrained(path, backend="pil")(images=[a, b], return_tensors="pt")
    with torch.no_grad():
        rows = torch.stack(list(model.model.get_image_features(pixels["pixel_values"]).pooler_output))
    text = {"type": "text", "text": "what is it?"}
    by_image = chat(urls[0], [{"type": "image_url", "image_url": {"url": data_url(a)}}, text])
    by_rows = chat(urls[0], [{"type": "image_embeds", "image_embeds": torch_b64(rows[0])}, text])
    assert by_image.status_code == by_rows.status_code == 200, by_rows.text
    assert by_rows.json()["usage"]["prompt_tokens"] == by_image.json()["usage"]["prompt_tokens"]
    got, want = (r.json()["choices"][0] for r in (by_rows, by_image))
    assert got["message"]["content"] == want["message"]["content"]
    np.testing.assert_allclose([t["logprob"] for t in got["logprobs"]["content"]],
                               [t["logprob"] for t in want["logprobs"]["content"]], atol=2e-4)
    for url, part, words in ((urls[0], torch_b64(rows), ["must hold one image's embeddings", "got 2"]),
                             (urls[0], "bm90IGEgdGVuc29y", ["content[0]['image_embeds'] must be base64"]),
                             (urls[1], torch_b64(rows[0]), ["content[0]", "image"])):
        response = chat(url, [{"type": "image_embeds", "image_embeds": part}, text])
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and all(w in error["message"] for w in words), error["message"]
    messages = [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": rows[0].numpy()}, text]}]
    out = engine(path, enable_mm_embeds=True).chat(messages, SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].text == got["message"]["content"]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\] is image embeddings: .*enable_mm_embeds=True"):
        engine(path).chat(messages, SamplingParams(**GREEDY), use_tqdm=False)


def test_a_qwen_vl_server_counts_and_answers_as_llm_chat():
    """Qwen2.5-VL over HTTP: usage counts the image's tokens (by its size) and the answer is LLM.chat's; a
    request's mm_processor_kwargs (vLLM's field) make its image smaller, in /tokenize too; a bad one is a 400."""
    from tests.engine.test_images_qwen import engine as qwen_engine, qwen_vl
    path, _ = qwen_vl("qwen2_5_vl")
    a = image(11, (100, 70))
    content = [{"type": "image_url", "image_url": {"url": data_url(a)}}, {"type": "text", "text": "what is it?"}]
    messages = [{"role": "user", "content": content}]
    small = {"max_pixels": 28 * 28 * 4}
    served = AsyncLLM.from_engine_args(tiny_engine_args(model=path), use_tqdm=False)
    try:
        with serving(build_app(served, [MODEL])) as (url,):
            response = chat(url, content)
            resized = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 6, "temperature": 0, "messages": messages, "mm_processor_kwargs": small})
            tokenized = httpx.post(url + "/tokenize", timeout=60, json={
                "model": MODEL, "messages": messages, "mm_processor_kwargs": small}).json()
            bad = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": messages, "mm_processor_kwargs": "max_pixels=4"})
    finally:
        served.shutdown()
    assert response.status_code == 200, response.text
    llm = qwen_engine(path)
    ref = llm.chat(messages, SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert response.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert response.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
    assert resized.status_code == 200, resized.text
    ref = llm.chat(messages, SamplingParams(**GREEDY), use_tqdm=False, mm_processor_kwargs=small)[0]
    assert resized.json()["usage"]["prompt_tokens"] == tokenized["count"] == len(ref.prompt_token_ids) < \
        response.json()["usage"]["prompt_tokens"]
    assert resized.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mm_processor_kwargs", bad.text
