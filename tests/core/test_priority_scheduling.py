"""vLLM's scheduling_policy="priority" without a model: waiting requests admitted by (priority, arrival),
the running request of the lowest priority preempted first, a request that outranks the swapped-out ones
admitted before they come back; "fcfs" keeps arrival order. The fake pools of test_swap_and_fork check
that every request reads back its own tokens through every preemption."""

import random

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.request_queue import FCFSQueue, PriorityQueue, priority_key
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from tests.core.fake_step import fake_params
from tests.core.test_swap_and_fork import BS, Driver, assert_pools_empty


def make_scheduler(policy, num_blocks=64, mode="recompute", max_num_seqs=8, budget=32, num_host_blocks=16):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
                             preemption_mode=mode, policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks, BS, num_host_blocks=num_host_blocks))


def make_request(request_id, priority, arrival, prompt_len=8, max_tokens=4):
    prompt = [(sum(map(ord, request_id)) * 37 + i) % 1000 for i in range(prompt_len)]
    return Request(request_id, prompt, fake_params(max_tokens), arrival_time=float(arrival), priority=priority)


def first_steps(driver) -> dict[str, int]:
    """Each request's first step in the plan."""
    firsts = {}
    for step, out in enumerate(driver.outputs):
        for chunk in out.chunks:
            firsts.setdefault(chunk.request.request_id, step)
    return firsts


def test_the_queues_pop_in_their_policys_order():
    requests = [make_request(name, p, t) for name, p, t in [("a", 2, 0), ("b", 0, 1), ("c", 1, 2), ("d", 0, 3),
                                                            ("e", 0, 1)]]
    fcfs, prio = FCFSQueue(), PriorityQueue()
    for r in requests:
        fcfs.add(r)
        prio.add(r)
    assert [r.request_id for r in fcfs] == list("abcde")
    # by priority, then arrival, then id (b and e arrived together)
    assert [r.request_id for r in prio] == list("bedca")
    prio.remove(requests[3])
    fcfs.remove(requests[3])
    with pytest.raises(ValueError):
        prio.remove(requests[3])
    prio.prepend(requests[3])   # a preempted request goes back to its place, not to the front
    fcfs.prepend(requests[3])
    assert [prio.pop().request_id for _ in range(len(prio))] == list("bedca")
    assert [fcfs.pop().request_id for _ in range(len(fcfs))] == list("dabce")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_requests_run_by_priority_then_arrival(policy):
    s = make_scheduler(policy, max_num_seqs=1)   # one at a time: the admission order is the finish order
    for name, priority, arrival in [("a", 2, 0), ("b", 0, 1), ("c", 1, 2), ("d", 0, 3)]:
        s.add_request(make_request(name, priority, arrival))
    driver = Driver(s)
    driver.run()
    order = sorted(first_steps(driver), key=first_steps(driver).get)
    assert order == (["b", "d", "c", "a"] if policy == "priority" else ["a", "b", "c", "d"])
    assert_pools_empty(s)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_lowest_priority_running_request_is_preempted_first(policy, mode):
    # 6 usable blocks; each request grows to 5 (8 + 10 - 1 tokens): one must make room for the other
    s = make_scheduler(policy, num_blocks=7, mode=mode)
    low, high = make_request("low", 1, 0, max_tokens=10), make_request("high", 0, 1, max_tokens=10)
    s.add_request(low)
    driver = Driver(s)
    driver.step()   # low runs first, then high arrives
    s.add_request(high)
    while not s.num_preemptions:
        out = driver.step()
    # fcfs takes the newest running request; priority the one of the highest (priority, arrival)
    assert out.preempted == ([low] if policy == "priority" else [high])
    driver.run()
    assert [r.num_output_tokens for r in (low, high)] == [10, 10]
    assert_pools_empty(s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_outranking_the_swapped_ones_is_admitted_before_they_return(policy):
    s = make_scheduler(policy, num_blocks=7, mode="swap")
    a, b = make_request("a", 1, 0, max_tokens=10), make_request("b", 1, 1, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    driver = Driver(s)
    while not s.swapped:
        driver.step()
    swapped_at = len(driver.outputs)
    assert list(s.swapped) == [b]
    s.add_request(make_request("urgent", 0, 2, prompt_len=4, max_tokens=2))
    s.add_request(make_request("late", 2, 3, prompt_len=4, max_tokens=2))
    driver.run()
    firsts = first_steps(driver)
    back = min(step for step, out in enumerate(driver.outputs) if step >= swapped_at
               and any(c.request is b for c in out.chunks))
    if policy == "priority":   # urgent before b comes back; late (outranked by b) not before it
        assert firsts["urgent"] < back <= firsts["late"]
    else:                      # swapped requests come back before any new one
        assert back <= firsts["urgent"] <= firsts["late"]
    assert_pools_empty(s)


@pytest.mark.parametrize("seed", range(6))
def test_random_priorities_and_aborts_keep_every_token_and_the_order(seed):
    """Arrivals, aborts and preemptions at random: every request reads back its own tokens (the driver),
    the running list stays in priority order (check_invariants), nothing leaks, and no request is
    admitted while one of a lower key waits."""
    rng = random.Random(seed)
    s = make_scheduler("priority", num_blocks=12, mode=rng.choice(["recompute", "swap", "auto"]), max_num_seqs=4,
                       budget=rng.choice([8, 32]))
    driver = Driver(s)
    names = iter(range(1000))
    for step in range(400):
        for _ in range(rng.choice([0, 0, 1, 2]) if step < 60 else 0):
            n = next(names)
            s.add_request(make_request(f"r{n}", rng.randint(-2, 2), step, rng.randint(1, 12), rng.randint(1, 8)))
        if s.requests and rng.random() < 0.05:
            s.finish_request(rng.choice(sorted(s.requests)), RequestStatus.FINISHED_ABORTED)
        waiting = {r.request_id for r in s.waiting if r.num_computed_tokens == 0 and r.num_preemptions == 0}
        out = driver.step()
        admitted = [c.request for c in out.chunks if c.request.request_id in waiting]
        if admitted:
            worst = max(map(priority_key, admitted))
            assert all(priority_key(r) >= worst for r in s.waiting), "a request ran before one that outranks it"
        if step >= 60 and not s.has_unfinished():
            break
    assert not s.has_unfinished()
    assert_pools_empty(s)


def test_fcfs_is_the_default_and_unknown_policies_are_refused():
    assert SchedulerConfig().policy == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        SchedulerConfig(policy="lifo")
