"""A step that raises (dispatch, block moves or fetch) poisons nothing: its requests are aborted,
the blocks it was writing leave the prefix cache, no block leaks, and every later request (and
every request the step did not touch) gets exactly the tokens of a fresh engine."""

import functools

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.llm_engine import StepFailedError
from tests.tiny_models import tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
rng = np.random.default_rng(11)
PROMPTS = [rng.integers(3, 320, n).tolist() for n in (40, 27, 19, 33, 12, 45)]


def make_llm(**kwargs) -> LLM:
    opts = dict(dtype="float32", block_size=8, num_gpu_blocks_override=96, max_model_len=128,
                compile_on_startup=False, max_num_seqs=8)
    return LLM(tiny_checkpoint("llama"), **{**opts, **kwargs})


@functools.cache
def reference() -> list[list[int]]:
    """Each prompt alone on a fresh engine without prefix caching."""
    llm = make_llm(enable_prefix_caching=False)
    return [list(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
            for p in PROMPTS]


def fail_nth_call(monkeypatch, obj, name: str, n: int) -> list[int]:
    """Make obj.name raise on its n-th call (1-based), once; returns the call counter."""
    original = getattr(obj, name)
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError(f"injected failure in {name}")
        return original(*args, **kwargs)
    monkeypatch.setattr(obj, name, wrapper)
    return calls


def assert_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"
    assert engine.kv_cache.host_usage() == 0.0, "host blocks leaked"
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("where", ["_executables", "sample", "fetch"])
def test_a_failed_prefill_leaves_no_cached_prefix(monkeypatch, where):
    llm = make_llm()
    runner = llm.llm_engine.runner
    fail_nth_call(monkeypatch, runner, where, 1)
    with pytest.raises(StepFailedError, match="injected failure") as info:
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
    assert info.value.request_ids == ["gen-0"]
    assert_clean(llm)
    # the same prompt again: nothing of the failed prefill is reused, the tokens are a fresh engine's
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert list(out.outputs[0].token_ids) == reference()[0]
    # and from now on the prefix is cached again, correctly
    again = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and list(again.outputs[0].token_ids) == reference()[0]
    assert_clean(llm)


@pytest.mark.parametrize("where, n", [("fetch", 3), ("dispatch", 4)])
def test_a_failed_step_aborts_only_its_requests_and_the_rest_finish_exactly(monkeypatch, where, n):
    llm = make_llm()
    engine = llm.llm_engine
    # two requests run first; the others arrive while they decode (so they are in other steps)
    for i in (0, 1):
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, GREEDY)
    fail_nth_call(monkeypatch, engine.runner, where, n)
    finished, failed = {}, []
    step = 0
    while engine.has_unfinished_requests():
        if step == 2:
            for i in range(2, len(PROMPTS)):
                engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, GREEDY)
        step += 1
        try:
            outputs = engine.step()
        except StepFailedError as exc:
            failed += exc.request_ids
            continue
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert failed and set(failed).isdisjoint(finished)
    assert set(failed) | set(finished) == {f"r{i}" for i in range(len(PROMPTS))}
    for request_id, out in finished.items():
        assert list(out.outputs[0].token_ids) == reference()[int(request_id[1:])], request_id
    assert_clean(llm)
    # the failed prompts run again: fresh-engine tokens
    outs = llm.generate([{"prompt_token_ids": PROMPTS[int(r[1:])]} for r in failed], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [reference()[int(r[1:])] for r in failed]
    assert_clean(llm)


def test_a_failed_swap_out_aborts_the_swapped_request_and_loses_nothing_else(monkeypatch):
    # 14 blocks of 8 tokens cannot hold six requests of up to 53 tokens: the newest get swapped out
    llm = make_llm(num_gpu_blocks_override=15, max_model_len=64, preemption_mode="swap", swap_space=0.01)
    engine = llm.llm_engine
    swaps = fail_nth_call(monkeypatch, engine.runner.swap_space, "swap_out", 1)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
    finished, failed = {}, []
    while engine.has_unfinished_requests():
        try:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        except StepFailedError as exc:
            failed += exc.request_ids
    assert swaps, "the workload never swapped: the test would prove nothing"
    assert failed and set(failed).isdisjoint(finished)
    assert llm.get_metrics()["jaxpaged:num_preemptions_total"] > 0
    for request_id, out in finished.items():
        assert list(out.outputs[0].token_ids) == reference()[int(request_id[1:])], request_id
    assert_clean(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference()
    assert_clean(llm)


def test_a_failed_held_back_sampler_still_delivers_the_step_it_applied(monkeypatch):
    # with a constrained request running, step() applies step t and then queues step t+1's sampler;
    # when that fails, what step t finished must still reach its requests
    from jaxpaged import StructuredOutputsParams
    llm = make_llm()
    engine = llm.llm_engine
    engine.add_request("short", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0.0, max_tokens=3,
                                                                                   ignore_eos=True))
    engine.add_request("json", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(
        temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex="[a-z]{30}")))
    applied, held_back = [], []
    complete, sample = engine._complete, engine.runner.sample

    def recording_complete():
        outputs = complete()
        applied.extend(outputs)
        return outputs

    def failing_sample(pending):
        if any(o.request_id == "short" and o.finished for o in applied) and not held_back:
            held_back.append(pending)
            raise RuntimeError("injected failure in sample")
        return sample(pending)
    monkeypatch.setattr(engine, "_complete", recording_complete)
    monkeypatch.setattr(engine.runner, "sample", failing_sample)
    with pytest.raises(StepFailedError) as info:
        while engine.has_unfinished_requests():
            engine.step()
    assert held_back and info.value.request_ids == ["json"]
    final = [o for o in info.value.outputs if o.request_id == "short"]
    assert final and final[0].finished and list(final[0].outputs[0].token_ids) == reference()[1][:3]
    assert_clean(llm)
