"""Async scheduling: step t+1 is planned and dispatched before step t's tokens are fetched,
and nothing a user sees changes (tokens, text, stops, seeds, logprobs, freed blocks)."""

import jax
import numpy as np
import pytest

from jaxpaged import SamplingParams
from tests.engine.test_memory_features import make_llm, workload


def _record_calls(llm) -> list[tuple[str, int]]:
    """Wrap the runner so every dispatch and fetch is logged as (kind, step number)."""
    runner = llm.llm_engine.runner
    calls = []
    dispatch, fetch = runner.dispatch, runner.fetch

    def logged_dispatch(*args, **kwargs):
        pending = dispatch(*args, **kwargs)
        pending.test_step = sum(kind == "dispatch" for kind, _ in calls)
        calls.append(("dispatch", pending.test_step))
        return pending

    def logged_fetch(pending):
        calls.append(("fetch", pending.test_step))
        return fetch(pending)

    runner.dispatch, runner.fetch = logged_dispatch, logged_fetch
    return calls


def _workload():
    rng = np.random.default_rng(11)
    prompts = [{"prompt_token_ids": rng.integers(3, 320, n).tolist()} for n in (3, 17, 40, 9, 25, 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [greedy,
              SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=20, seed=9, max_tokens=7, ignore_eos=True),
              greedy]
    return prompts, params


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, round(c.cumulative_logprob, 4),
              [sorted(lp) for lp in c.logprobs] if c.logprobs else None) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def llms():
    return make_llm(async_scheduling=True), make_llm(async_scheduling=False)


def test_next_step_is_dispatched_before_the_previous_is_fetched(llms):
    on, off = llms
    prompts, params = _workload()
    calls = _record_calls(on)
    on.generate(prompts, params, use_tqdm=False)
    # every step after the first is dispatched while its predecessor is still in flight (the last
    # one, whose requests all stopped with the step before, stays in flight until the next call)
    num_steps = sum(kind == "dispatch" for kind, _ in calls)
    dispatched_early = [calls.index(("dispatch", k + 1)) < calls.index(("fetch", k)) for k in range(num_steps - 1)]
    assert num_steps > 20 and all(dispatched_early)

    calls = _record_calls(off)
    off.generate(prompts, params, use_tqdm=False)
    assert calls == [(kind, k) for k in range(len(calls) // 2) for kind in ("dispatch", "fetch")]


def test_outputs_are_identical_with_and_without_async_scheduling(llms):
    on, off = llms
    prompts, params = _workload()
    before = [llm.get_metrics()["jaxpaged:generation_tokens_total"] for llm in llms]
    a = on.generate(prompts, params, use_tqdm=False)
    b = off.generate(prompts, params, use_tqdm=False)
    assert _summary(a) == _summary(b)
    assert [len(c.token_ids) for o in a for c in o.outputs] == [12, 10, 1, 30, 7, 12]
    for llm, count in zip(llms, before):
        metrics = llm.get_metrics()
        assert metrics["jaxpaged:kv_cache_usage_perc"] == 0.0
        # tokens computed for requests that had already stopped are not counted
        assert metrics["jaxpaged:generation_tokens_total"] - count == 72


def test_stops_mid_flight_drop_the_extra_token(llms):
    """A request that stops on a token (stop id, stop string) at step t was already scheduled for
    step t+1: that extra token must not reach the output, and its blocks are freed."""
    on, off = llms
    prompt = {"prompt_token_ids": [5, 17, 230, 41, 9]}
    free = off.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[4]
    stop_text = free.text[len(free.text) // 2:][:3].strip() or free.text[-2:]
    cases = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop_text]),
             SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=6)]
    for params in cases:
        a = on.generate([prompt, prompt], [params, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)],
                        use_tqdm=False)
        b = off.generate([prompt, prompt], [params, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)],
                         use_tqdm=False)
        assert _summary(a) == _summary(b)
        assert a[0].outputs[0].finish_reason == "stop"
        assert len(a[0].outputs[0].token_ids) < 16
    assert on.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0


def _overlapped(calls) -> bool:
    """Every step after the first was dispatched before its predecessor was fetched."""
    num_steps = sum(kind == "dispatch" for kind, _ in calls)
    return all(calls.index(("dispatch", k + 1)) < calls.index(("fetch", k)) for k in range(num_steps - 1))


def test_penalties_min_tokens_and_forks_keep_steps_overlapped(llms):
    """Penalty counts, min_tokens masks and n > 1 forks live on the device, so such requests
    never wait for their tokens on the host: steps stay overlapped, with the same results as
    without async scheduling."""
    on, off = llms
    prompt = {"prompt_token_ids": [5, 17, 230, 41, 9]}
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5,
                               frequency_penalty=0.5, presence_penalty=0.3)
    calls = _record_calls(on)
    a = on.generate(prompt, penalized, use_tqdm=False)
    assert len(calls) > 20 and _overlapped(calls)
    assert _summary(a) == _summary(off.generate(prompt, penalized, use_tqdm=False))
    # the penalties matter here: without them the greedy tokens differ
    assert a[0].outputs[0].token_ids != off.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids

    forked = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, frequency_penalty=1.0)
    calls = _record_calls(on)
    a = on.generate(prompt, forked, use_tqdm=False)
    assert _overlapped(calls)
    assert _summary(a) == _summary(off.generate(prompt, forked, use_tqdm=False))
    assert len({tuple(o.token_ids) for o in a[0].outputs}) == 3


def test_an_interrupted_generate_leaves_the_engine_usable(llms):
    """Ctrl-C (or an error) while a step is in flight: that call's requests are dropped, their blocks
    freed, and the next generate gives the same outputs as an engine that was never interrupted."""
    on, off = llms
    prompts, params = _workload()
    runner = on.llm_engine.runner
    fetch = runner.fetch
    count = [0]

    def interrupted_fetch(pending):
        count[0] += 1
        if count[0] == 5:
            raise KeyboardInterrupt
        return fetch(pending)

    runner.fetch = interrupted_fetch
    with pytest.raises(KeyboardInterrupt):
        on.generate(prompts, params, use_tqdm=False)
    assert on.get_metrics()["jaxpaged:num_requests_running"] == 0
    assert _summary(on.generate(prompts, params, use_tqdm=False)) == _summary(off.generate(prompts, params,
                                                                                          use_tqdm=False))
    assert on.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_a_request_id_reused_after_an_abort_mid_flight_gets_its_own_prompt_logprobs(llms):
    on, off = llms
    engine = on.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    engine.add_request("x", {"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17, 18]}, params)
    engine.step()                      # its prefill is on the device
    engine.abort_request("x")
    engine.add_request("x", {"prompt_token_ids": [40, 41, 42]}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "x"]
    expected = off.generate({"prompt_token_ids": [40, 41, 42]}, params, use_tqdm=False)[0]
    got = outputs[-1]
    assert got.finished and got.prompt_token_ids == [40, 41, 42]
    assert [None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()} for d in got.prompt_logprobs] == \
        [None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()} for d in expected.prompt_logprobs]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids


def test_preemption_while_a_step_is_in_flight_keeps_outputs(llms):
    """A 24-block pool preempts requests (recompute or swap) whose tokens are still on the device;
    seeded sampling rows check that a preempted request resumes its random stream exactly."""
    prompts, greedy = workload()
    params = [p if i % 2 else SamplingParams(temperature=0.8, seed=i, max_tokens=p.max_tokens, ignore_eos=True)
              for i, p in enumerate(greedy)]
    results = []
    for async_scheduling in (True, False):
        for mode in ("recompute", "swap"):
            llm = make_llm(async_scheduling=async_scheduling, num_gpu_blocks_override=24, preemption_mode=mode,
                           enable_prefix_caching=False, swap_space=0.001)
            results.append(_summary(llm.generate(prompts, params, use_tqdm=False)))
            metrics = llm.get_metrics()
            assert metrics["jaxpaged:num_preemptions_total"] > 0
            assert metrics["jaxpaged:kv_cache_usage_perc"] == 0.0
    assert all(r == results[0] for r in results[1:])


def test_a_decode_step_sends_its_inputs_in_one_transfer(llms, monkeypatch):
    """Block tables, sampling parameters and penalty counts stay on the device: once a request
    runs, each step moves one host buffer to the device and nothing else (no implicit transfers)."""
    engine = llms[0].llm_engine
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True, frequency_penalty=0.5,
                            logit_bias={7: -1.0}, min_tokens=30)
    engine.add_request("one-transfer", {"prompt_token_ids": [5, 17, 230]}, params)
    for _ in range(3):   # the prompt, and the request's slot filled
        engine.step()
    puts = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: (puts.append(type(x)), device_put(x, *a, **k))[1])
    with jax.transfer_guard_host_to_device("disallow"):
        for _ in range(20):   # crosses block boundaries: appended blocks ride in the same buffer
            engine.step()
    assert puts == [np.ndarray] * 20
    while engine.has_unfinished_requests():
        engine.step()


def _constrained_workload():
    """Unconstrained requests beside constrained ones whose allowed next token depends on the one
    before (an alternation), a choice that stops its request mid-flight, and n = 2 forks."""
    from jaxpaged import StructuredOutputsParams

    prompts, params = _workload()
    alternating = StructuredOutputsParams(regex="(ab|ba|cd|dc){6}")
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    prompts += [{"prompt_token_ids": [5, 17, 230]}, {"prompt_token_ids": [9, 8, 7, 6]}, {"prompt_token_ids": [40]}]
    params += [SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=alternating),
               SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=20, structured_outputs=alternating),
               SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs=choice)]
    return prompts, params


def test_a_constrained_request_keeps_steps_overlapped(llms):
    """Structured outputs: step t+1's forward is dispatched before step t is fetched, with the
    outputs of an engine without async scheduling."""
    on, off = llms
    prompts, params = _constrained_workload()
    calls = _record_calls(on)
    a = on.generate(prompts, params, use_tqdm=False)
    assert _overlapped(calls) and sum(kind == "dispatch" for kind, _ in calls) > 20
    assert _summary(a) == _summary(off.generate(prompts, params, use_tqdm=False))
    assert on.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_the_mask_of_step_t_plus_1_is_filled_after_step_t_is_applied(llms, monkeypatch):
    """A constrained step's sampler is queued (its mask filled) after the previous step's tokens
    advanced the matchers and before the step is fetched: an alternation, whose every second
    token depends on the one before, stays valid; a choice stops mid-flight; n = 2 forks."""
    import re

    on, off = llms
    prompts, params = _constrained_workload()
    calls = _record_calls(on)
    runner = on.llm_engine.runner
    sample = runner.sample

    def logged_sample(pending):
        if hasattr(pending, "test_step") and not pending.is_sampled:   # deferred (dispatch queues the rest)
            calls.append(("sample", pending.test_step))
        return sample(pending)

    monkeypatch.setattr(runner, "sample", logged_sample)
    a = on.generate(prompts, params, use_tqdm=False)
    deferred = [k for kind, k in calls if kind == "sample"]
    assert len(deferred) > 10
    assert all(k == 0 or calls.index(("fetch", k - 1)) < calls.index(("sample", k)) < calls.index(("fetch", k))
               for k in deferred)
    assert _summary(a) == _summary(off.generate(prompts, params, use_tqdm=False))
    for out in a[6:8]:
        for c in out.outputs:
            assert re.fullmatch("(ab|ba|cd|dc){6}", c.text) and c.finish_reason == "stop", c.text
    assert a[8].outputs[0].text in ("yes", "no", "maybe") and a[8].outputs[0].finish_reason == "stop"
