"""Helpers of the server tests: apps served by uvicorn on loopback ports, and the Prometheus metrics read back."""

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

MODEL = "tiny-llama"   # the name the server tests serve their tiny engine under
# One client for the helpers' many small requests (metrics polled every 50 ms, fuzzed bodies): httpx.get
# and httpx.post build a client each, with an SSL context even for http:// (~20 ms of a core each time).
HTTP = httpx.Client(timeout=60)


def start(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serving(*apps):
    """The apps served by uvicorn on free loopback ports, stopped on exit; yields their URLs."""
    servers = [start(app) for app in apps]
    try:
        yield [url for _, _, url in servers]
    finally:
        for server, thread, _ in servers:
            server.should_exit = True
            thread.join(10)


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in HTTP.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def gauge(values: dict, name: str) -> float:
    return values[f'jaxpaged:{name}{{model_name="{MODEL}"}}']


def wait_idle(url: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        busy = [gauge(values, n) for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if busy == [0, 0, 0]:
            return values
        assert time.monotonic() < deadline, f"still busy: {values}"
        time.sleep(0.05)


@contextlib.contextmanager
def serving_tiny_engine(**overrides):
    """A tiny AsyncLLM (test_async_llm.tiny_engine_args(**overrides)) served under MODEL; yields its URL."""
    from jaxpaged import AsyncLLM
    from jaxpaged.server import build_app
    from tests.server.test_async_llm import tiny_engine_args

    engine = AsyncLLM.from_engine_args(tiny_engine_args(**overrides), use_tqdm=False)
    try:
        with serving(build_app(engine, [MODEL])) as urls:
            yield urls[0]
    finally:
        engine.shutdown()


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
