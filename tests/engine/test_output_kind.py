"""SamplingParams.output_kind: DELTA outputs add up to the CUMULATIVE ones, FINAL_ONLY gives one
output per request, and LLM.generate and AsyncLLM.generate pick the kind they need themselves."""

import asyncio
import copy
import time

import pytest

from jaxpaged import AsyncLLM, RequestOutputKind, SamplingParams
from tests.engine.test_memory_features import make_llm

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPT = "Hello world"
SUCCESS = "jaxpaged:request_success_total"


@pytest.fixture(scope="module")
def llms():
    """Async scheduling on (the default) and off; no prefix cache, so reruns compute the same way."""
    return {mode: make_llm(async_scheduling=mode, enable_prefix_caching=False) for mode in (True, False)}


def run(engine, requests: dict) -> dict:
    """Step the engine until `requests` ({id: (prompt, params)}) finish; returns {id: [outputs]}."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def joined(deltas, index: int) -> tuple:
    """Completion `index` of a DELTA stream, put together: (text, token ids, logprobs)."""
    parts = [c for out in deltas for c in out.outputs if c.index == index]
    return ("".join(c.text for c in parts), sum((c.token_ids for c in parts), []),
            sum((c.logprobs for c in parts), []))


def a_stop_string(llm) -> str:
    """Two characters from the middle of the free-running greedy text, so the stop string matches."""
    text = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop) == 2 and stop.strip(), f"no usable stop string in {text!r}"
    return stop


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_deltas_with_logprobs_and_a_stop_string_add_up_to_the_cumulative_output(llms, async_scheduling):
    llm = llms[async_scheduling]
    stop = a_stop_string(llm)
    params = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2, stop=[stop])
    cumulative = run(llm.llm_engine, {"c": (PROMPT, SamplingParams(**params, output_kind=CUMULATIVE))})["c"]
    deltas = run(llm.llm_engine, {"d": (PROMPT, SamplingParams(**params, output_kind=DELTA))})["d"]
    final = cumulative[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert len(deltas) == len(cumulative) and [d.finished for d in deltas] == [c.finished for c in cumulative]
    assert joined(deltas, 0) == (final.text, final.token_ids, final.logprobs)
    last = deltas[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert last.cumulative_logprob == pytest.approx(final.cumulative_logprob)
    assert all(d.outputs[0].finish_reason is None for d in deltas[:-1])
    # the prompt's logprobs come once, with the first output
    assert deltas[0].prompt_logprobs == cumulative[-1].prompt_logprobs
    assert len(deltas[0].prompt_logprobs) == len(deltas[0].prompt_token_ids)
    assert all(d.prompt_logprobs is None for d in deltas[1:])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_n2_seeded_deltas_add_up_per_completion_index(llms, async_scheduling):
    engine = llms[async_scheduling].llm_engine
    params = dict(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=2)
    final = run(engine, {"c": (PROMPT, SamplingParams(**params, output_kind=CUMULATIVE))})["c"][-1]
    deltas = run(engine, {"d": (PROMPT, SamplingParams(**params, output_kind=DELTA))})["d"]
    assert final.outputs[0].token_ids != final.outputs[1].token_ids
    for c in final.outputs:
        assert joined(deltas, c.index) == (c.text, c.token_ids, c.logprobs)
    for d in deltas:
        indices = [c.index for c in d.outputs]
        assert indices == sorted(set(indices)) and set(indices) <= {0, 1}
    assert {c.index: c.finish_reason for d in deltas for c in d.outputs} == {0: "length", 1: "length"}


def test_each_delta_holds_only_the_steps_new_token(llms):
    engine = llms[False].llm_engine   # one token per sequence per step
    requests = {"one": (PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=DELTA)),
                "two": ("Paged", SamplingParams(n=2, seed=3, max_tokens=6, ignore_eos=True, output_kind=DELTA))}
    outputs = run(engine, requests)
    for request_id, max_tokens in (("one", 10), ("two", 6)):
        assert all(len(c.token_ids) <= 1 for out in outputs[request_id] for c in out.outputs)
        assert len(outputs[request_id]) == max_tokens


def test_final_only_gives_one_finished_output_per_request(llms):
    engine = llms[True].llm_engine

    def requests(kind):
        return {"short": (PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, output_kind=kind)),
                "long": ("Paged", SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=1,
                                                 output_kind=kind)),
                "n2": ("Hi", SamplingParams(n=2, seed=5, max_tokens=7, ignore_eos=True, output_kind=kind))}
    cumulative = run(engine, requests(CUMULATIVE))
    final_only = run(engine, requests(FINAL_ONLY))
    for request_id, outputs in final_only.items():
        assert len(outputs) == 1 and outputs[0].finished
        assert outputs[0].outputs == cumulative[request_id][-1].outputs


def test_llm_generate_returns_final_outputs_and_leaves_the_callers_params_alone(llms):
    llm = llms[True]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=DELTA)
    before = (params.clone(), params.was_set("top_p"), params.was_set("output_kind"))
    out = llm.generate([PROMPT, "Paged"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5] and all(o.finished for o in out)
    # the same batch without output_kind: the same outputs to the bit
    plain = llm.generate([PROMPT, "Paged"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.outputs for o in out] == [o.outputs for o in plain]
    assert (params, params.was_set("top_p"), params.was_set("output_kind")) == before
    assert params.output_kind == DELTA


def test_output_kind_must_be_a_request_output_kind():
    with pytest.raises(ValueError, match="output_kind") as err:
        SamplingParams(output_kind="delta")
    assert "'delta'" in str(err.value) and "RequestOutputKind.FINAL_ONLY" in str(err.value)
    params = SamplingParams(output_kind=DELTA)
    assert params.was_set("output_kind") and not SamplingParams().was_set("output_kind")
    assert params.clone().output_kind is DELTA and SamplingParams().output_kind is CUMULATIVE


@pytest.fixture
def async_llm(llms):
    engine = AsyncLLM(llms[True].llm_engine)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("output_kind", ["delta", "cumulative"])
def test_a_slow_async_consumer_gets_the_queued_deltas_merged(llms, async_llm, output_kind):
    params = SamplingParams(n=2, seed=11, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    whole = llms[True].generate(PROMPT, params, use_tqdm=False)[0]

    async def main():
        done = async_llm.get_metrics()[SUCCESS] + 1
        stream = async_llm.generate(PROMPT, params, output_kind=output_kind)
        first = await anext(stream)
        first_as_received = copy.deepcopy(first)
        deadline = time.monotonic() + 60
        while async_llm.get_metrics()[SUCCESS] < done and time.monotonic() < deadline:
            await asyncio.sleep(0.02)   # the request runs to its end while nobody reads
        await asyncio.sleep(0.02)       # its last outputs reach the queue
        return [first] + [out async for out in stream], first_as_received

    outputs, first_as_received = asyncio.run(main())
    assert outputs[-1].finished and len(outputs) < 8, "the queued outputs should have come as one"
    if output_kind == "delta":
        got = [joined(outputs, i) for i in (0, 1)]
        assert outputs[0].prompt_logprobs == whole.prompt_logprobs
    else:
        got = [(c.text, c.token_ids, c.logprobs) for c in outputs[-1].outputs]
        assert outputs[-1].prompt_logprobs == whole.prompt_logprobs
    assert got == [(c.text, c.token_ids, c.logprobs) for c in whole.outputs]
    assert outputs[0] == first_as_received, "an output already handed out changed as later ones arrived"
