"""How the server meets load and faults: a full queue answers 503 with Retry-After, a client that
hangs up before its first token aborts its prefill, a dying engine loop turns /health to 503 and
ends the process with status 1, and SIGTERM drains in-flight streams and exits 0."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app, serve
from tests.server.test_async_llm import tiny_engine_args
from tests.server.helpers import MODEL, serving, wait_idle
from tests.tiny_models import tiny_checkpoint


@pytest.fixture(scope="module")
def engine():
    # two seats, small prompt chunks: a 200-token prompt takes 13 steps to prefill
    llm = AsyncLLM.from_engine_args(tiny_engine_args(max_num_seqs=2, max_num_batched_tokens=16), use_tqdm=False,
                                    max_num_waiting=2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with serving(build_app(engine, [MODEL])) as urls:
        yield urls[0]


@pytest.fixture
def slow_steps(engine, monkeypatch):
    step = engine.engine.step

    def slow_step(*args, **kwargs):
        time.sleep(0.03)
        return step(*args, **kwargs)
    monkeypatch.setattr(engine.engine, "step", slow_step)


def test_a_full_queue_answers_503_with_retry_after(url, slow_steps):
    async def one(http, i):
        body = {"prompt": [5 + i, 6, 7], "max_tokens": 30, "ignore_eos": True, "temperature": 0.0}
        return await http.post(url + "/v1/completions", json=body)

    async def burst():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(8)))
    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 4 + [503] * 4   # 2 seats + 2 waiting; the rest come back later
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["code"] == "overloaded" and "max_num_waiting 2" in error["message"]
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(url)
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_when_kv_blocks_not_seats_run_out_the_queue_still_fills(monkeypatch):
    # 8 seats but KV blocks for two requests: once a step left requests waiting, the next one is refused
    engine = AsyncLLM.from_engine_args(tiny_engine_args(max_num_seqs=8, num_gpu_blocks_override=12, max_model_len=64), use_tqdm=False,
                                       max_num_waiting=2)
    step, late_answered = engine.engine.step, threading.Event()

    def two_run_two_wait(m):
        return m["jaxpaged:num_requests_running"] >= 2 and m["jaxpaged:num_requests_waiting"] >= 2

    def held_step(*args, **kwargs):   # once two wait, no step runs until the late request is answered: no race
        time.sleep(0.02)
        if two_run_two_wait(engine.engine.get_metrics()) and not late_answered.is_set():
            return []
        return step(*args, **kwargs)
    monkeypatch.setattr(engine.engine, "step", held_step)
    # 35 prompt tokens + 4: 5 blocks each, so two fit in the 11 usable blocks
    body = lambda i: {"prompt": [5 + i] + list(range(10, 44)), "max_tokens": 4, "ignore_eos": True,  # noqa: E731
                      "temperature": 0.0}
    try:
        with serving(build_app(engine, [MODEL])) as (url,):
            async def main():
                async with httpx.AsyncClient(timeout=60) as http:
                    first = [asyncio.ensure_future(http.post(url + "/v1/completions", json=body(i)))
                             for i in range(4)]   # four in: two run, two wait for blocks
                    deadline = time.monotonic() + 20
                    while not two_run_two_wait(engine.get_metrics()):
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.02)
                    late = await http.post(url + "/v1/completions", json=body(9))
                    late_answered.set()
                    return late, await asyncio.gather(*first)
            late, first = asyncio.run(main())
            assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
            assert [r.status_code for r in first] == [200] * 4
            wait_idle(url)
    finally:
        engine.shutdown()


def test_hanging_up_before_the_first_token_aborts_the_prefill(url, slow_steps):
    prompt = list(range(3, 203))   # 25 blocks of 8
    body = b'{"prompt": %s, "max_tokens": 5, "stream": true}' % str(prompt).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.1)   # the request is in; its prefill has begun
    wait_idle(url, timeout=5)
    # what the prefill computed is in the prefix cache: not the whole prompt (a finished prefill of
    # 13 steps of 30 ms caches 192 tokens)
    again = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] < 160, again["usage"]


def test_a_dead_engine_loop_is_503_at_once_and_ends_the_process_with_1():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, [MODEL]), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    status = []
    # the watchdog looks every 5 s here (0.1 s by default), so /health can still be asked before it
    # shuts the server down
    thread = threading.Thread(target=lambda: status.append(serve(server, engine, poll_s=5.0)), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.get(url + "/health").status_code == 200

        def broken():   # a bug in the loop itself, outside any step
            raise RuntimeError("the engine loop broke")
        engine.engine.has_work = broken
        response = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        died = time.monotonic()   # the request saw the loop die
        health = httpx.get(url + "/health")
        took = time.monotonic() - died
        # /health reads the loop's state on each call: 503 at once (2 s of slack for a loaded test machine)
        assert health.status_code == 503 and took < 2.0, (health.status_code, took)
        assert health.json()["error"]["code"] == "engine_dead"
        thread.join(30)
        assert status == [1], status
    finally:
        server.should_exit = True
        engine.shutdown()


def test_sigterm_lets_the_streams_in_flight_finish_and_exits_0(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "jaxpaged.cli", "serve", tiny_checkpoint("llama"), "--port", str(port),
               "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "32", "--num-gpu-blocks-override", "96", "--shutdown-timeout", "20",
               "--uvicorn-log-level", "warning"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "temperature": 0.0, "stream": True}
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    if len(chunks) == 3:
                        proc.send_signal(signal.SIGTERM)
                        time.sleep(0.5)   # uvicorn stops accepting at once
                        with pytest.raises(httpx.ConnectError):
                            httpx.get(url + "/health", timeout=2)
        assert chunks[-1] == "[DONE]" and '"finish_reason":"length"' in chunks[-2]   # drained, not cut
        assert proc.wait(30) == 0, open(log.name).read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
