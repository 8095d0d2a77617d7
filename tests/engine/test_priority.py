"""vLLM's priority scheduling through the engine: the priority of each request decides who runs first on a
pool too small for all, greedy outputs stay those of the plain engine, and a priority the engine cannot
honour is a ValueError that queues nothing."""

import pytest

from tests.engine.test_llm_generate import tiny_llm
from tests.engine.test_memory_features import make_llm, plain_outputs, workload


def test_priority_decides_who_runs_first_and_outputs_stay_the_same():
    """A dozen requests, the last added the most urgent, on a pool of 24 blocks (a few at a time) with
    swap preemption: first tokens come in priority order, not in arrival order, and every output is the
    plain engine's."""
    llm = make_llm(num_gpu_blocks_override=24, enable_prefix_caching=False, preemption_mode="swap",
                   swap_space=0.001, scheduling_policy="priority")
    engine = llm.llm_engine
    prompts, params = workload()
    priorities = [-i // 3 for i in range(len(prompts))]   # 0, 0, 0, -1, -1, -1, ... -3
    for i, (prompt, sp, priority) in enumerate(zip(prompts, params, priorities)):
        engine.add_request(f"r{i}", prompt, sp, priority=priority)
    first, outputs, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == plain_outputs()
    by_priority = sorted(range(len(prompts)), key=lambda i: (priorities[i], i))
    steps = [first[f"r{i}"] for i in by_priority]
    assert steps == sorted(steps) and steps[0] < first["r0"], steps   # r0 arrived first, runs among the last
    metrics = llm.get_metrics()
    assert metrics["jaxpaged:num_preemptions_total"] > 0 and metrics["jaxpaged:kv_cache_usage_perc"] == 0.0


def test_priority_under_fcfs_and_bad_priorities_are_refused_and_queue_nothing():
    llm = tiny_llm()
    prompts = [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": [9, 100]}]
    with pytest.raises(ValueError, match=r"priority=1 needs scheduling_policy='priority' \(this engine's is "
                                         r"'fcfs'\); allowed here: 0"):
        llm.generate(prompts, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match=r"priority must be a list of one int per prompt \(2\)"):
        llm.generate(prompts, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority must be an int, got str"):
        llm.llm_engine.add_request("x", prompts[0], priority="high")
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0
    outs = llm.generate(prompts, use_tqdm=False, priority=[0, 0])
    assert all(o.finished for o in outs)


def test_the_flag_reaches_the_engine_arguments_which_refuse_unknown_policies():
    import argparse

    from jaxpaged.cli import add_engine_args, engine_kwargs
    from jaxpaged.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--scheduling-policy", "priority"]))["scheduling_policy"] == "priority"
    assert engine_kwargs(parser.parse_args([]))["scheduling_policy"] == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy must be one of 'fcfs', 'priority'"):
        EngineArgs(scheduling_policy="lifo")
