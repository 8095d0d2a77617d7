"""Sleep mode over HTTP (--enable-sleep-mode: vLLM's /sleep, /wake_up, /is_sleeping) and the
research calls of AsyncLLM (update_weights, pause and resume) on the engine thread."""

import asyncio

import httpx
import numpy as np
import pytest

from jaxpaged import AsyncLLM
from jaxpaged.server import build_app
from tests.server.test_async_llm import greedy, run_to_end, tiny_engine_args
from tests.server.helpers import serving

PROMPT = [5, 17, 42, 9]


@pytest.fixture(scope="module")
def engine():
    llm = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    yield llm
    llm.shutdown()


def completion(url: str) -> list[int]:
    body = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 6,
                                                     "temperature": 0, "logprobs": 1}, timeout=60).json()
    return body["choices"][0]["logprobs"]["tokens"]


def test_sleep_routes_release_and_restore_the_engine(engine):
    with serving(build_app(engine, ["m"], enable_sleep_mode=True), build_app(engine, ["m"])) as (url, plain):
        before = completion(url)
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert httpx.post(url + "/sleep", params={"level": "3"}).status_code == 400
        assert httpx.post(url + "/sleep", params={"level": "1"}).status_code == 200
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        refused = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 400 and "wake_up" in refused.json()["error"]["message"]
        assert httpx.post(url + "/wake_up").status_code == 200
        assert completion(url) == before
        assert httpx.post(plain + "/sleep").status_code == 404   # off without --enable-sleep-mode


def test_update_weights_and_pause_run_between_steps(engine):
    async def main():
        tokens = (await run_to_end(engine, PROMPT, greedy(6)))[-1].outputs[0].token_ids
        name = "model.layers.0.mlp.down_proj.weight"
        await engine.update_weights({name: np.zeros((64, 128), np.float32)})
        changed = (await run_to_end(engine, PROMPT, greedy(6)))[-1].outputs[0].token_ids
        await engine.pause_generation()
        task = asyncio.create_task(run_to_end(engine, PROMPT, greedy(6)))
        await asyncio.sleep(0.5)
        assert not task.done()   # paused: it waits
        await engine.resume_generation()
        assert (await task)[-1].outputs[0].token_ids == changed
        with pytest.raises(ValueError, match="shape"):
            await engine.update_weights({name: np.zeros((3, 3), np.float32)})
        return tokens, changed

    tokens, changed = asyncio.run(main())
    assert tokens != changed
