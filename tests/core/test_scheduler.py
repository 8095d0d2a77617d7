"""The scheduler driven by a fake model: each step "computes" the scheduled tokens into a fake
KV pool (block id -> slot -> token id) and samples a predictable token, so a test sees what a
user would: who ran, how many tokens, in what order, and whether every request got its output."""

import random

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from tests.core.fake_step import FakeStepResult, fake_params


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=32,
                   max_model_len=None, chunked=True, caching=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len or max_num_batched_tokens,
                             enable_chunked_prefill=chunked)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=caching))


def make_request(request_id, prompt, max_tokens=4):
    if isinstance(prompt, int):   # distinct per request id, the same in every run
        prompt = [(sum(map(ord, request_id)) * 37 + i) % 1000 for i in range(prompt)]
    return Request(request_id, prompt, fake_params(max_tokens))


def fake_token(request):
    """Depends only on the request and position, so a resumed request samples what it would have."""
    return (sum(map(ord, request.request_id)) * 31 + request.num_tokens) % 1000


class Driver:
    """Runs the schedule -> fake step -> update loop and checks what a model runner relies on."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.kv = {}          # block id -> {slot: token id}: what the device pool would hold
        self.outputs = []     # every SchedulerOutput, in order
        self.finished = {}    # request id -> Request, finished by length (max_tokens or max_model_len)

    def step(self):
        s = self.scheduler
        out = s.schedule()
        bs = s.kv_cache.block_size
        assert out.num_batched_tokens == sum(c.num_new_tokens for c in out.chunks)
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        # like a model step: every layer writes its new K/V before any attention reads the pool
        for c in out.chunks:
            assert c.num_new_tokens > 0 and c.start == c.request.num_computed_tokens
            assert c.start + c.num_new_tokens <= c.request.num_tokens
            assert len(c.block_ids) * bs >= c.start + c.num_new_tokens
            assert 0 not in c.block_ids and len(set(c.block_ids)) == len(c.block_ids)
            for pos in range(c.start, c.start + c.num_new_tokens):
                self.kv.setdefault(c.block_ids[pos // bs], {})[pos % bs] = c.request.all_token_ids[pos]
        for c in out.chunks:
            end = c.start + c.num_new_tokens
            seen = [self.kv.get(c.block_ids[p // bs], {}).get(p % bs) for p in range(end)]
            assert seen == c.request.all_token_ids[:end], f"{c.request} reads stale K/V"
        sampled = {c.request.request_id: fake_token(c.request) for c in out.chunks if c.samples}
        update = s.update_from_output(out, FakeStepResult(out, sampled))
        for c in out.chunks:
            assert c.request.all_token_ids == c.request.prompt_token_ids + c.request.output_token_ids
        for request, status, _ in update.finished:   # the scheduler's length stops
            assert status == RequestStatus.FINISHED_LENGTH and request.status == status
            assert request.num_output_tokens >= request.max_tokens or request.num_tokens >= s.config.max_model_len
            self.finished[request.request_id] = request
        for request in s.running:
            assert request.num_output_tokens < request.max_tokens and request.num_tokens < s.config.max_model_len
        s.check_invariants()
        self.outputs.append(out)
        return out

    def run(self, max_steps=500):
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        s = self.scheduler
        raise AssertionError(f"not done after {max_steps} steps: {s.running} {s.waiting}")


def chunk_sizes(out):
    return {c.request.request_id: c.num_new_tokens for c in out.chunks}


def assert_no_blocks_held(scheduler):
    kv = scheduler.kv_cache
    assert kv.usage() == 0.0
    assert kv.pool.num_free_blocks() == kv.pool.num_usable_blocks
    assert kv.req_blocks == {}


def test_token_budget_is_respected_and_used_when_there_is_work():
    s = make_scheduler(max_num_batched_tokens=16)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 10, max_tokens=3))
    driver = Driver(s)
    first = driver.step()
    assert first.num_batched_tokens == 16           # r0's prompt and 6 tokens of r1's
    assert chunk_sizes(first) == {"r0": 10, "r1": 6}
    driver.run()
    assert max(o.num_batched_tokens for o in driver.outputs) == 16


def test_at_most_max_num_seqs_run_at_once():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)  # room for more but for the limit
    for i in range(7):
        s.add_request(make_request(f"r{i}", 4, max_tokens=5))
    driver = Driver(s)
    out = driver.step()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1", "r2"]
    assert len(s.running) == 3 and len(s.waiting) == 4
    while s.has_unfinished():
        driver.step()
        assert len(s.running) <= 3
    assert len(driver.finished) == 7


def test_running_requests_come_first_then_waiting_ones_in_arrival_order():
    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request("b", 3, max_tokens=9))
    s.add_request(make_request("a", 3, max_tokens=9))
    driver = Driver(s)
    driver.step()
    for request_id in ("z", "c", "y"):
        s.add_request(make_request(request_id, 3, max_tokens=9))
    out = driver.step()
    assert [c.request.request_id for c in out.chunks] == ["b", "a", "z", "c", "y"]


def test_a_step_mixes_decodes_and_a_new_prompt():
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(make_request("old", 6, max_tokens=10))
    driver = Driver(s)
    driver.step()
    s.add_request(make_request("new", 11, max_tokens=10))
    out = driver.step()
    assert chunk_sizes(out) == {"old": 1, "new": 11}
    assert s.requests["old"].num_output_tokens == 2 and s.requests["new"].num_output_tokens == 1


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_flowing():
    s = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    s.add_request(make_request("dec", 3, max_tokens=20))
    driver = Driver(s)
    driver.step()
    s.add_request(make_request("long", 30, max_tokens=2))
    long, long_chunks = s.requests["long"], []
    while not long.output_token_ids:
        sizes = chunk_sizes(driver.step())
        assert sizes["dec"] == 1                       # the decode is never starved
        long_chunks.append(sizes["long"])
        # a token is sampled only once the whole prompt is in
        assert long.num_output_tokens == (sum(long_chunks) == 30)
    assert long_chunks == [7, 7, 7, 7, 2]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    def run(chunked):
        s = make_scheduler(max_num_batched_tokens=16, chunked=chunked)
        s.add_request(make_request("dec", 3, max_tokens=4))
        s.add_request(make_request("dec2", 3, max_tokens=4))
        driver = Driver(s)
        driver.step()
        s.add_request(make_request("big", 15, max_tokens=1))   # the longest prompt max_model_len 16 admits
        return [chunk_sizes(driver.step()) for _ in range(4)]

    assert run(chunked=True)[0] == {"dec": 1, "dec2": 1, "big": 14}
    # the decodes need one token each per step for 3 more steps; "big" needs 15 of the 16
    assert run(chunked=False) == [{"dec": 1, "dec2": 1}] * 3 + [{"big": 15}]


def test_preemption_recomputes_the_newest_request_which_later_finishes():
    # 6 usable blocks of 4 tokens; "old" and "new" each grow past 2 blocks
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=32)
    s.add_request(make_request("old", 8, max_tokens=10))
    s.add_request(make_request("new", 8, max_tokens=9))
    driver = Driver(s)
    driver.step()
    s.add_request(make_request("later", 16, max_tokens=5))   # 4 blocks: cannot join
    new = s.requests["new"]
    for _ in range(20):
        tokens_before = list(new.output_token_ids)
        out = driver.step()
        if s.num_preemptions:
            break
    assert out.preempted == [new]
    assert [c.request.request_id for c in out.chunks] == ["old"]
    assert s.num_preemptions == 1 and new.num_preemptions == 1
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0
    assert s.kv_cache.blocks_of("new") == []
    assert [r.request_id for r in s.waiting] == ["new", "later"]
    assert new.output_token_ids == tokens_before and len(tokens_before) == 5

    driver.run()
    assert driver.finished["new"].num_output_tokens == 9
    assert driver.finished["new"].output_token_ids[:5] == tokens_before
    assert driver.finished["old"].num_output_tokens == 10
    assert driver.finished["later"].num_output_tokens == 5
    assert_no_blocks_held(s)


def test_preempted_request_resumes_with_its_cached_prefix():
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=32)
    s.add_request(make_request("old", 8, max_tokens=7))
    s.add_request(make_request("new", 8, max_tokens=9))
    driver = Driver(s)
    new = s.requests["new"]
    while not new.num_preemptions or new.status != RequestStatus.RUNNING:
        out = driver.step()
        assert len(driver.outputs) < 50, "never preempted and resumed"
    # its full blocks were freed but stayed cached: only what was evicted is recomputed
    resumed = next(c for c in out.chunks if c.request is new)
    assert resumed.start > 0 and resumed.start % 4 == 0
    assert resumed.start + resumed.num_new_tokens == new.num_tokens - 1   # one token sampled since
    driver.run()
    assert driver.finished["new"].num_output_tokens == 9


def test_abort_of_waiting_and_running_requests_frees_their_blocks():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("run", 5, max_tokens=10))
    s.add_request(make_request("wait", 5, max_tokens=10))
    driver = Driver(s)
    driver.step()
    assert s.kv_cache.usage() > 0.0

    aborted = s.finish_request("wait", RequestStatus.FINISHED_ABORTED)
    assert aborted.is_finished and aborted.status.finish_reason == "abort"
    assert list(s.waiting) == []

    out = s.schedule()
    aborted = s.finish_request("run", RequestStatus.FINISHED_ABORTED)
    # a step already planned for an aborted request brings it no token
    s.update_from_output(out, FakeStepResult(out, {"run": 42}))
    assert 42 not in aborted.output_token_ids
    assert s.running == [] and not s.has_unfinished()
    assert s.finish_request("run", RequestStatus.FINISHED_ABORTED) is None
    s.check_invariants()
    assert_no_blocks_held(s)


@pytest.mark.parametrize("prompt, max_tokens, match", [
    (0, 4, "at least 1 token"),
    (64, 1, "max_model_len is 64: the prompt must be at most 63 tokens"),
    (17, 17, "KV cache"),                # 32 tokens of K/V fit 8 blocks; 33 do not
])
def test_a_request_that_can_never_fit_is_rejected(prompt, max_tokens, match):
    s = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        s.add_request(make_request("x", prompt, max_tokens))
    assert not s.has_unfinished()
    s.add_request(make_request("fits", 17, max_tokens=16))   # exactly 8 blocks
    driver = Driver(s)
    driver.run()
    assert driver.finished["fits"].num_output_tokens == 16


def test_output_stops_at_max_model_len_so_a_request_never_outgrows_the_pool():
    # 4 usable blocks = 16 tokens = max_model_len: max_tokens=30 would never fit on its own
    s = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16, chunked=False)
    s.add_request(make_request("a", 6, max_tokens=30))
    s.add_request(make_request("b", 6, max_tokens=30))
    driver = Driver(s)
    driver.run()
    assert s.num_preemptions > 0
    assert {k: r.num_output_tokens for k, r in driver.finished.items()} == {"a": 10, "b": 10}
    assert_no_blocks_held(s)


def test_duplicate_request_id_is_rejected():
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    Driver(s).step()
    with pytest.raises(ValueError, match="'a'"):
        s.add_request(make_request("a", 4))
    assert len(s.running) == 1 and not s.waiting


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_on_tiny_pools(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    chunked = seed % 2 == 0
    budget = rng.randint(4, 12) if chunked else rng.randint(16, 24)
    max_model_len = 48 if chunked else budget
    s = make_scheduler(num_blocks=1 + -(-rng.randint(16, 32) // block_size), block_size=block_size,
                       max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=budget,
                       max_model_len=max_model_len, chunked=chunked, caching=seed % 4 != 3)
    capacity = s.kv_cache.max_tokens_per_request()
    shared = [rng.randrange(50) for _ in range(8)]       # a common prefix makes cache hits likely
    driver, aborted, added = Driver(s), set(), {}
    for step in range(1000):
        if step < 80 and rng.random() < 0.4:
            prompt = shared[:rng.randint(0, 8)]
            prompt += [rng.randrange(50) for _ in range(rng.randint(1, 20 if chunked else 8))]
            request = make_request(f"r{step}", prompt, rng.randint(1, 16))
            if len(prompt) < max_model_len and min(len(prompt) + request.max_tokens - 1, max_model_len) <= capacity:
                s.add_request(request)
                added[request.request_id] = request
            else:
                with pytest.raises(ValueError):
                    s.add_request(request)
                assert request.request_id not in s.requests
        if s.requests and rng.random() < 0.04:
            victim = rng.choice(sorted(s.requests))
            s.finish_request(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
            s.check_invariants()
        if step >= 80 and not s.has_unfinished():
            break
        driver.step()
    assert not s.has_unfinished(), "requests still unfinished after 1000 steps"
    assert len(added) >= 12 and s.num_preemptions > 0
    assert not chunked or any(c.start + c.num_new_tokens < c.request.num_prompt_tokens
                              for o in driver.outputs for c in o.chunks), "no prompt was split"
    for request_id, request in added.items():
        if request_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert request.num_output_tokens <= request.max_tokens
        else:
            assert request.status == RequestStatus.FINISHED_LENGTH
            room = max_model_len - request.num_prompt_tokens
            assert request.num_output_tokens == max(1, min(request.max_tokens, room))
    assert_no_blocks_held(s)


@pytest.mark.parametrize("budget", [32, 3])
def test_speculative_drafts_are_planned_verified_and_taken_back(budget):
    """Decodes carry their drafts (trimmed to the budget and max_tokens); after the fake step the
    request keeps its accepted drafts plus the true next token, its rejected drafts' slots are
    computed again, and every computed position holds the request's own token."""
    s = make_scheduler(block_size=4, max_num_batched_tokens=budget, max_model_len=64)
    request = make_request("a", 6, max_tokens=23)
    s.add_request(request)
    truth = lambda pos: (7 * pos + 3) % 1000   # noqa: E731 - the fake model's token at `pos`
    rng = random.Random(budget)
    kv = {}
    while not request.is_finished:
        if request.num_output_tokens:   # propose 3 drafts, each right with probability 0.7
            n = request.num_tokens
            request.spec_token_ids = [truth(n + j) if rng.random() < 0.7 else 999 for j in range(3)]
        out = s.schedule()
        (chunk,) = out.chunks
        assert chunk.num_new_tokens <= budget and chunk.num_drafts <= min(3, budget - 1)
        assert request.num_output_tokens + chunk.num_drafts + 1 <= request.max_tokens
        tokens = request.all_token_ids[chunk.start:chunk.start + chunk.num_new_tokens - chunk.num_drafts]
        tokens += request.spec_token_ids[:chunk.num_drafts]
        bs = s.kv_cache.block_size
        for i, token in enumerate(tokens):
            pos = chunk.start + i
            kv[(chunk.block_ids[pos // bs], pos % bs)] = token
        # verify: keep drafts while they are the true tokens, then the true token
        first = chunk.start + chunk.num_new_tokens - chunk.num_drafts   # position of the first new token
        kept = [truth(first)]
        for j, draft in enumerate(tokens[len(tokens) - chunk.num_drafts:]):
            if draft != kept[-1]:
                break
            kept.append(truth(first + j + 1))
        update = s.update_from_output(out, FakeStepResult(out, {"a": kept[0]} if chunk.samples else {},
                                                          {"a": kept[1:]} if chunk.samples else {}))
        assert request.spec_token_ids == []
        if request.is_finished:   # max_tokens, reached with the last kept token
            assert update.finished == [(request, RequestStatus.FINISHED_LENGTH, None)]
            break
        if chunk.samples:
            assert request.num_computed_tokens == request.num_tokens - 1
        blocks = s.kv_cache.blocks_of("a")
        for pos in range(request.num_computed_tokens):
            assert kv[(blocks[pos // bs], pos % bs)] == request.all_token_ids[pos]
    assert request.output_token_ids == [truth(6 + i) for i in range(23)]
