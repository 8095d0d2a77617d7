"""The serving benchmark's load generator against an in-process server on a tiny random model:
the numbers it reports add up (tokens from the usage, TTFT before E2E, percentiles ordered)."""

import asyncio

import pytest

from jaxpaged import AsyncLLM
from jaxpaged.benchmarks.serve import Server, jaxpaged_body, level_work, make_workload, run_level, summarize
from jaxpaged.server import build_app
from tests.server.test_async_llm import tiny_engine_args
from tests.server.helpers import MODEL, start


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    uvicorn_server, thread, url = start(build_app(engine, [MODEL]))
    yield Server("jaxpaged", url, MODEL, jaxpaged_body)
    uvicorn_server.should_exit = True
    thread.join(10)
    engine.shutdown()


def workload(count: int, cap: int):
    work = make_workload(count, vocab=320, seed=1)   # token-id prompts: the tiny model has a 320-token vocabulary
    return level_work([ids[:8] for ids, _ in work], [n for _, n in work], count, cap)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_reported_numbers_are_consistent(server, concurrency):
    work = workload(6, cap=12)
    records, wall = asyncio.run(run_level(server, work, concurrency, timeout_s=60))
    assert len(records) == len(work) and all(r.error is None for r in records), [r.error for r in records]
    assert sorted(r.output_tokens for r in records) == sorted(n for _, n in work)   # ignore_eos: exactly max_tokens
    assert all(r.prompt_tokens == 8 for r in records)
    for r in records:
        assert 0 < r.ttft <= r.e2e <= wall
        assert len(r.itls) == len(r.chunk_times) - 1 and all(gap >= 0 for gap in r.itls)
        assert len(r.chunk_times) <= r.output_tokens

    result = summarize("jaxpaged", concurrency, len(work), records, wall)
    assert (result.completed, result.failed) == (len(work), 0)
    assert result.output_tokens == sum(n for _, n in work)
    assert result.request_throughput == pytest.approx(len(work) / wall)
    assert result.output_throughput == pytest.approx(result.output_tokens / wall)
    for p50, p99 in (result.ttft_ms, result.itl_ms, result.e2e_s):
        assert 0 <= p50 <= p99
    assert result.ttft_ms[1] <= 1e3 * result.e2e_s[1]
    assert result.itl_ms[0] <= result.itl_ms[1] and result.mean_itl_ms > 0


def test_a_failed_request_is_reported_not_raised(server):
    wrong = Server("jaxpaged", server.base_url, "no-such-model", jaxpaged_body)
    records, wall = asyncio.run(run_level(wrong, workload(2, cap=4), 2, timeout_s=30))
    result = summarize("jaxpaged", 2, 2, records, wall)
    assert (result.completed, result.failed) == (0, 2) and "404" in result.first_error
