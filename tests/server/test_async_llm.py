"""AsyncLLM on a tiny random llama: shared batches, validation, abort, cancellation, failures."""

import asyncio
import time

import pytest

from jaxpaged import AsyncLLM, EngineArgs, SamplingParams
from jaxpaged.engine.async_llm import EngineRequestError
from tests.tiny_models import tiny_checkpoint

RUNNING, WAITING = "jaxpaged:num_requests_running", "jaxpaged:num_requests_waiting"
KV_USAGE = "jaxpaged:kv_cache_usage_perc"
PROMPTS = [[5, 17, 42], [100, 3, 250, 7], [9, 9], [311, 64, 128, 30, 2]]


def tiny_engine_args(**overrides) -> EngineArgs:
    return EngineArgs(**{"model": tiny_checkpoint("llama"), "dtype": "float32", "block_size": 8,
                         "num_gpu_blocks_override": 96, "max_model_len": 256, "compile_on_startup": False,
                         **overrides})


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def run_to_end(llm, prompt, params, request_id=None, output_kind="cumulative"):
    outputs = [out async for out in llm.generate({"prompt_token_ids": prompt}, params, request_id,
                                                 output_kind=output_kind)]
    return outputs


def test_default_outputs_are_deltas_that_add_up_to_the_whole(llm):
    params = greedy(8)
    whole = asyncio.run(run_to_end(llm, PROMPTS[0], params))[-1].outputs[0]
    deltas = asyncio.run(run_to_end(llm, PROMPTS[0], params, output_kind="delta"))
    assert len(deltas) > 1 and deltas[-1].finished
    assert sum((d.outputs[0].token_ids for d in deltas), []) == whole.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert all(len(d.outputs[0].token_ids) < len(whole.token_ids) for d in deltas)


async def wait_until_idle(llm, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = llm.get_metrics()
        if metrics[RUNNING] == metrics[WAITING] == metrics[KV_USAGE] == 0:
            return metrics
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine still busy after {timeout}s: {llm.get_metrics()}")


def count_steps(llm, monkeypatch) -> list[int]:
    calls = []
    step = llm.engine.step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)
    monkeypatch.setattr(llm.engine, "step", counted)
    return calls


def test_concurrent_requests_share_batches_and_match_solo_runs(llm, monkeypatch):
    params = greedy(8)
    solo = [asyncio.run(run_to_end(llm, p, params))[-1] for p in PROMPTS]
    steps = count_steps(llm, monkeypatch)

    async def together():
        return await asyncio.gather(*(run_to_end(llm, p, params) for p in PROMPTS))
    streams = asyncio.run(together())
    # one at a time would take about 4 * 9 steps; sharing a batch about 9 (+ a few joins)
    assert len(steps) < 2 * 9, f"{len(steps)} steps for 4 concurrent requests of 8 tokens"
    for outputs, alone in zip(streams, solo):
        final = outputs[-1]
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == alone.outputs[0].token_ids
        assert final.outputs[0].text == alone.outputs[0].text
        # cumulative outputs: each one extends the previous
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and not any(o.finished for o in outputs[:-1])
        assert final.metrics.first_token_time <= final.metrics.finished_time


def test_outputs_are_built_off_the_engine_thread_and_stop_strings_still_end_requests(llm, monkeypatch):
    """The engine thread only schedules, launches, fetches and places tokens; text, stop strings and
    RequestOutputs are the output thread's. A stop string found there ends the request (its blocks
    freed) with the text cut before it."""
    import threading

    threads = {"step": set(), "process": set()}
    engine = llm.engine
    step, process = engine.step, engine.output_processor.process
    monkeypatch.setattr(engine, "step",
                        lambda **kw: threads["step"].add(threading.current_thread().name) or step(**kw))
    monkeypatch.setattr(engine.output_processor, "process",
                        lambda steps: threads["process"].add(threading.current_thread().name) or process(steps))
    plain = asyncio.run(run_to_end(llm, PROMPTS[1], greedy(12)))[-1].outputs[0]
    stop = plain.text[3:6]
    assert len(stop) == 3, plain.text
    stopped = asyncio.run(run_to_end(llm, PROMPTS[1], greedy(12, stop=[stop])))[-1].outputs[0]
    assert threads == {"step": {"jaxpaged-engine"}, "process": {"jaxpaged-outputs"}}
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == plain.text[:plain.text.index(stop)]
    asyncio.run(wait_until_idle(llm))


def test_bad_input_raises_before_any_output_and_queues_nothing(llm):
    async def main():
        with pytest.raises(ValueError, match="prompt token id 999"):
            await anext(llm.generate({"prompt_token_ids": [1, 999]}, greedy(4)))
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await anext(llm.generate({"prompt_token_ids": []}, greedy(4)))
        with pytest.raises(ValueError, match="sampling_params"):
            await anext(llm.generate("hi", {"temperature": 0.0}))
    asyncio.run(main())
    assert llm.get_metrics()[RUNNING] == 0


def test_duplicate_request_id_is_refused_without_hurting_the_first(llm):
    async def main():
        first = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(6), "dup", output_kind="cumulative")
        out = await anext(first)
        with pytest.raises(ValueError, match="already in use"):
            await anext(llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(6), "dup"))
        async for out in first:
            pass
        return out
    final = asyncio.run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 6


def test_abort_frees_blocks_at_once_and_ends_the_stream(llm):
    async def main():
        stream = llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(200), "to-abort")
        out = await anext(stream)
        assert not out.finished and llm.get_metrics()[KV_USAGE] > 0
        await llm.abort("to-abort")
        metrics = llm.get_metrics()     # no waiting: the blocks are free when abort returns
        rest = [o async for o in stream]
        return metrics, rest
    metrics, rest = asyncio.run(main())
    assert metrics[RUNNING] == 0 and metrics[KV_USAGE] == 0
    assert not any(o.finished for o in rest)


def test_cancelling_or_leaving_the_consumer_aborts_the_request(llm):
    async def consume(request_id):
        async for out in llm.generate({"prompt_token_ids": PROMPTS[2]}, greedy(200), request_id,
                                      output_kind="cumulative"):
            seen.append(out)

    async def main():
        task = asyncio.create_task(consume("cancelled"))
        while not seen:
            await asyncio.sleep(0.01)
        task.cancel()
        await wait_until_idle(llm)
        stream = llm.generate({"prompt_token_ids": PROMPTS[3]}, greedy(200), "left")
        await anext(stream)
        await stream.aclose()           # `break` out of `async for`, then the generator is closed
        return await wait_until_idle(llm)

    seen = []
    before = llm.get_metrics()["jaxpaged:request_success_total"]
    after = asyncio.run(main())
    assert after["jaxpaged:request_success_total"] == before   # neither ran to its 200 tokens


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(llm, monkeypatch):
    step = llm.engine.step

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(llm.engine, "step", step)
        raise RuntimeError("injected failure")

    async def main():
        monkeypatch.setattr(llm.engine, "step", fail_once)
        with pytest.raises(EngineRequestError, match="injected failure"):
            await run_to_end(llm, PROMPTS[0], greedy(5))
        await wait_until_idle(llm)
        return await run_to_end(llm, PROMPTS[0], greedy(5))
    outputs = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5
    assert llm.is_running


def test_shutdown_ends_requests_in_flight_and_refuses_new_ones():
    engine = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    assert engine.model_name == tiny_checkpoint("llama") and engine.max_model_len == 256

    async def main():
        stream = engine.generate({"prompt_token_ids": PROMPTS[0]}, greedy(200))
        await anext(stream)
        engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(RuntimeError, match="shut down"):
            await anext(engine.generate("hello", greedy(2)))
        await asyncio.wait_for(engine.abort("anything"), 5)   # returns instead of waiting forever
    asyncio.run(main())
    assert not engine.is_running


def test_a_step_failing_in_the_runner_fails_its_request_and_poisons_no_prefix(monkeypatch):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(), use_tqdm=False)
    prompt = list(range(3, 43))   # five full blocks of 8
    try:
        reference = asyncio.run(run_to_end(engine, prompt, greedy(6, seed=0)))[-1].outputs[0].token_ids
        engine.engine.kv_cache.pool.reset_prefix_cache()
        runner = engine.engine.runner
        step = runner._executables

        def fail_once(*args, **kwargs):
            monkeypatch.setattr(runner, "_executables", step)
            raise RuntimeError("injected failure")

        async def main():
            monkeypatch.setattr(runner, "_executables", fail_once)
            with pytest.raises(EngineRequestError, match="injected failure"):
                await run_to_end(engine, prompt, greedy(6))
            await wait_until_idle(engine)
            return await run_to_end(engine, prompt, greedy(6))
        final = asyncio.run(main())[-1]
        assert final.num_cached_tokens == 0            # the failed prefill's blocks were not kept
        assert final.outputs[0].token_ids == reference
        assert engine.is_running
    finally:
        engine.shutdown()
