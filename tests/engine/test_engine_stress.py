"""Randomized stress on the real engine (tiny model, tiny pools): random arrivals, lengths, n,
aborts and both preemption modes; refcounts and free lists are checked after every step."""

import numpy as np
import pytest

from jaxpaged import SamplingParams
from tests.engine.test_memory_features import make_llm


@pytest.mark.parametrize("mode,seed", [("swap", 0), ("recompute", 1)])
def test_random_workload_never_leaks_blocks(mode, seed):
    llm = make_llm(num_gpu_blocks_override=20, max_num_seqs=8, max_num_batched_tokens=32, preemption_mode=mode,
                   swap_space=0.0005, max_model_len=96)
    engine = llm.llm_engine
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 320, 16).tolist()
    expected_lengths, aborted, finished = {}, set(), {}
    next_id = 0
    for step in range(400):
        if next_id < 24 and rng.random() < 0.4:
            n_prompt = int(rng.integers(1, 40))
            prompt = (shared if rng.random() < 0.3 else []) + rng.integers(3, 320, n_prompt).tolist()
            params = SamplingParams(n=int(rng.integers(1, 4)), temperature=float(rng.choice([0.0, 1.0])),
                                    max_tokens=int(rng.integers(1, 12)), ignore_eos=True, seed=int(rng.integers(99)))
            rid = f"r{next_id}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            expected_lengths[rid] = (params.n, params.max_tokens)
            next_id += 1
        if engine.has_unfinished_requests() and rng.random() < 0.05:
            victim = str(rng.choice(sorted(engine.output_processor.states)))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.scheduler.check_invariants()
        if next_id >= 24 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    for rid, (n, max_tokens) in expected_lengths.items():
        if rid in aborted:
            continue
        out = finished[rid]
        assert len(out.outputs) == n
        assert all(len(c.token_ids) == max_tokens for c in out.outputs)
    m = llm.get_metrics()
    assert m["jaxpaged:kv_cache_usage_perc"] == 0.0
    assert engine.kv_cache.host_usage() == 0.0
    assert m["jaxpaged:num_requests_running"] == m["jaxpaged:num_requests_waiting"] == 0
    assert m["jaxpaged:num_preemptions_total"] > 0
