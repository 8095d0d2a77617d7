"""Swap preemption, copy-on-write forks (n > 1) and aborts, driven without a model.

A fake device pool and a fake host pool (block id -> {slot: token id}) follow every block move
a step asks for, in the order the runner does them (swap-outs, swap-ins, copy-on-write copies,
each as one gather then one scatter), before the step writes its tokens. After each step every
running request must read back exactly its own tokens through its block table, and every
swapped one through its host blocks: a missing copy, a wrong swap pair or a block reused while
still in use shows up as a wrong token."""

import random

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from tests.core.fake_step import FakeStepResult, fake_params

BS = 4


def make_scheduler(num_blocks, num_host_blocks=8, mode="swap", max_num_seqs=8, budget=32,
                   max_model_len=32, chunked=True):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked,
                             preemption_mode=mode)
    return Scheduler(config, KVCacheManager(num_blocks, BS, num_host_blocks=num_host_blocks))


def make_request(request_id, prompt, max_tokens, n=1):
    """Sequence 0 of a request; the other n - 1 fork off it when it samples (as the engine does)."""
    if isinstance(prompt, int):
        prompt = [(sum(map(ord, request_id)) * 37 + i) % 1000 for i in range(prompt)]
    params = fake_params(max_tokens, n=n)
    parent = Request(request_id, prompt, params)
    parent.pending_forks = [Request(f"{request_id}#{i}", prompt, params) for i in range(1, n)]
    return parent


def fake_token(request):
    """Depends on the sequence and position only, so siblings sample different tokens."""
    return (sum(map(ord, request.request_id)) * 31 + request.num_tokens) % 1000


def read(pool, blocks, num_tokens):
    return [pool.get(blocks[p // BS], {}).get(p % BS) if p // BS < len(blocks) else None
            for p in range(num_tokens)]


class Driver:
    def __init__(self, scheduler):
        self.s = scheduler
        self.device, self.host = {}, {}
        self.outputs = []
        self.sequences = {}          # every sequence that ran, forks included

    def move_blocks(self, out):
        # each list is one gather then one scatter on the device: read all sources first
        moves = ((out.swap_out, self.device, self.host), (out.swap_in, self.host, self.device),
                 (out.copies, self.device, self.device))
        for pairs, src_pool, dst_pool in moves:
            assert len({dst for _, dst in pairs}) == len(pairs), "two moves into one block"
            gathered = [dict(src_pool.get(src, {})) for src, _ in pairs]
            for (_, dst), content in zip(pairs, gathered):
                dst_pool[dst] = content

    def step(self):
        s, kv = self.s, self.s.kv_cache
        out = s.schedule()
        assert out.num_batched_tokens == sum(c.num_new_tokens for c in out.chunks)
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        for _, dst in out.copies:   # a copy lands in a block only its new owner holds
            assert sum(blocks.count(dst) for blocks in kv.req_blocks.values()) == 1
        self.move_blocks(out)
        for c in out.chunks:
            assert c.num_new_tokens > 0 and c.start == c.request.num_computed_tokens
            assert len(c.block_ids) * BS >= c.start + c.num_new_tokens and 0 not in c.block_ids
            for pos in range(c.start, c.start + c.num_new_tokens):
                self.device.setdefault(c.block_ids[pos // BS], {})[pos % BS] = c.request.all_token_ids[pos]
        # n > 1: the forks sample their first token beside their parent (commit forks them)
        sampled = {r.request_id: fake_token(r) for c in out.chunks if c.samples for r in (c.request, *c.forks)}
        update = s.update_from_output(out, FakeStepResult(out, sampled))
        for request, _ in update.progressed:
            self.sequences[request.request_id] = request
        self.check_read_back()
        assert all(request.num_output_tokens < request.max_tokens for request in s.running)   # length stops
        s.check_invariants()
        self.outputs.append(out)
        return out

    def check_read_back(self):
        kv = self.s.kv_cache
        for r in self.s.running:
            n = r.num_computed_tokens
            assert read(self.device, kv.blocks_of(r.request_id), n) == r.all_token_ids[:n], f"{r} reads bad K/V"
        for r in self.s.swapped:
            n = r.num_computed_tokens
            assert r.request_id not in kv.req_blocks and n > 0
            assert read(self.host, kv.req_host_blocks[r.request_id], n) == r.all_token_ids[:n], f"{r} swapped badly"
        for r in self.s.waiting:
            assert kv.num_swapped_blocks(r) == 0

    def run(self, max_steps=300):
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not done: {self.s.running} {self.s.waiting} {self.s.swapped}")


def assert_pools_empty(s):
    kv = s.kv_cache
    assert kv.usage() == 0.0 and kv.host_usage() == 0.0
    assert kv.req_blocks == {} and kv.req_host_blocks == {}


def run_until_preempted(driver, request_id):
    """Step until `request_id` is preempted; returns (that step's output, its blocks and outputs just before)."""
    s = driver.s
    while not s.num_preemptions:
        blocks, tokens = list(s.kv_cache.blocks_of(request_id)), list(s.requests[request_id].output_token_ids)
        out = driver.step()
        assert len(driver.outputs) < 50, "never preempted"
    assert [r.request_id for r in out.preempted] == [request_id]
    return out, blocks, tokens


def test_swap_round_trip_keeps_every_token_and_skips_recompute():
    # 6 usable blocks: "old" grows to 5 blocks, "new" to 4, so "new" must make room
    s = make_scheduler(num_blocks=7, num_host_blocks=8)
    s.add_request(make_request("old", 8, max_tokens=10))
    s.add_request(make_request("new", 8, max_tokens=9))
    driver = Driver(s)
    new = s.requests["new"]
    out, blocks_before, tokens_before = run_until_preempted(driver, "new")
    computed = new.num_computed_tokens
    assert new.status == RequestStatus.SWAPPED and list(s.swapped) == [new]
    assert computed > 8 and s.kv_cache.blocks_of("new") == []
    host_blocks = list(s.kv_cache.req_host_blocks["new"])
    assert out.swap_out == list(zip(blocks_before, host_blocks)) and len(host_blocks) == 3
    assert s.kv_cache.host_usage() == 3 / 8

    s.add_request(make_request("later", 4, max_tokens=2))   # must not overtake the swapped one
    while True:
        out = driver.step()
        ids = [c.request.request_id for c in out.chunks]
        if new.status != RequestStatus.SWAPPED:
            break
        assert "later" not in ids
    assert "later" not in ids or ids.index("new") < ids.index("later")
    assert [h for h, _ in out.swap_in] == host_blocks
    resumed = next(c for c in out.chunks if c.request is new)
    assert (resumed.start, resumed.num_new_tokens) == (computed, 1)   # nothing recomputed
    driver.run()
    assert new.output_token_ids[:len(tokens_before)] == tokens_before and new.num_output_tokens == 9
    assert [driver.sequences[r].num_output_tokens for r in ("old", "later")] == [10, 2]
    assert s.num_swapped_out_blocks == s.num_swapped_in_blocks == 3
    assert_pools_empty(s)


def test_full_host_pool_falls_back_to_recompute():
    s = make_scheduler(num_blocks=7, num_host_blocks=2)   # the victim holds 3 blocks
    s.add_request(make_request("old", 8, max_tokens=10))
    s.add_request(make_request("new", 8, max_tokens=9))
    driver = Driver(s)
    new = s.requests["new"]
    out, _, tokens_before = run_until_preempted(driver, "new")
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0
    assert list(s.waiting) == [new] and not s.swapped and out.swap_out == []
    assert s.kv_cache.host_usage() == 0.0 and s.num_swapped_out_blocks == 0
    driver.run()
    assert new.output_token_ids[:len(tokens_before)] == tokens_before and new.num_output_tokens == 9
    assert s.num_swapped_in_blocks == 0
    assert_pools_empty(s)


@pytest.mark.parametrize("prompt_len, expected_copies", [(18, 3), (16, 0)])
def test_four_forks_share_the_prompt_and_copy_only_a_partial_last_block(prompt_len, expected_copies):
    # 4 private copies of 20 tokens would need 20 blocks; shared, the 4 prompt blocks count once
    s = make_scheduler(num_blocks=11, budget=32)
    s.add_request(make_request("p", prompt_len, max_tokens=3, n=4))
    driver = Driver(s)
    driver.step()
    assert len(s.running) == 4
    shared = list(s.kv_cache.blocks_of("p"))
    assert all(s.kv_cache.blocks_of(r.request_id) == shared for r in s.running)
    peak = 0
    while s.has_unfinished():
        driver.step()
        peak = max(peak, s.kv_cache.usage())
    copies = [pair for out in driver.outputs for pair in out.copies]
    assert len(copies) == expected_copies      # one per child; the last writer keeps the original
    assert all(src == shared[-1] for src, _ in copies)
    assert s.num_preemptions == 0 and peak == 8 / 10
    outputs = [driver.sequences[f"p{suffix}"].output_token_ids for suffix in ("", "#1", "#2", "#3")]
    assert all(len(o) == 3 for o in outputs) and len({tuple(o) for o in outputs}) == 4
    assert_pools_empty(s)


@pytest.mark.parametrize("victim", ["p", "p#2"])
def test_abort_of_a_sequence_never_frees_blocks_its_siblings_still_use(victim):
    s = make_scheduler(num_blocks=12, budget=32)
    s.add_request(make_request("p", 18, max_tokens=6, n=3))
    driver = Driver(s)
    driver.step()
    shared = list(s.kv_cache.blocks_of("p"))
    s.finish_request(victim, RequestStatus.FINISHED_ABORTED)
    assert all(s.kv_cache.pool.ref_cnt[b] == 2 for b in shared)
    assert not set(shared) & set(s.kv_cache.pool.free_queue)
    s.check_invariants()
    # a newcomer takes every free block, so a block freed too early would be overwritten
    s.add_request(make_request("greedy", 20, max_tokens=8))
    driver.run()
    survivors = [r for r in ("p", "p#1", "p#2") if r != victim]
    assert [driver.sequences[r].num_output_tokens for r in survivors] == [6, 6]
    assert s.requests == {} and driver.sequences["greedy"].num_output_tokens == 8
    assert_pools_empty(s)


def test_n_larger_than_max_num_seqs_is_rejected():
    s = make_scheduler(num_blocks=12, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.add_request(make_request("p", 5, max_tokens=2, n=3))
    assert not s.has_unfinished()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_randomized_arrivals_forks_aborts_and_preemptions(mode, chunked, seed):
    rng = random.Random(f"{mode}-{chunked}-{seed}")
    max_model_len = 32
    s = make_scheduler(num_blocks=rng.choice([9, 11, 14]), num_host_blocks=rng.choice([3, 6, 12]),
                       mode=mode, max_num_seqs=rng.choice([4, 6]), chunked=chunked,
                       budget=rng.choice([8, 16]) if chunked else max_model_len)
    kv, shared = s.kv_cache, [rng.randrange(1000) for _ in range(8)]
    driver, parents, aborted, aborted_from = Driver(s), {}, set(), []
    abort_turns = ["running", "waiting", "swapped"][:3 if mode == "swap" else 2]
    aborted_swapped_blocks = 0
    for step in range(3000):
        if step < 120 and rng.random() < 0.35:
            prompt = shared[:rng.choice([0, 4, 6, 8])] + [rng.randrange(1000) for _ in range(rng.randint(1, 16))]
            max_tokens = rng.randint(1, max_model_len - len(prompt))
            request = make_request(f"r{step}", prompt, max_tokens, n=rng.choice([1, 1, 2, 3, 4]))
            parents[request.request_id] = [request] + request.pending_forks
            s.add_request(request)
        # aborts take turns over the queues (a turn waits until its queue has someone); requests
        # stay swapped only briefly, so that turn is taken at once
        status = abort_turns[len(aborted_from) % len(abort_turns)]
        queue = {"running": s.running, "waiting": s.waiting, "swapped": s.swapped}[status]
        if queue and rng.random() < (0.5 if status == "swapped" else 0.04):
            victim = rng.choice(list(queue))
            aborted_swapped_blocks += kv.num_swapped_blocks(victim)
            s.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED)
            # sequences that never forked off an aborted parent are aborted with it
            aborted |= {victim.request_id} | {c.request_id for c in victim.pending_forks}
            aborted_from.append(status)
            s.check_invariants()
            driver.check_read_back()
        if step >= 120 and not s.has_unfinished():
            break
        driver.step()
    assert not s.has_unfinished(), "requests still unfinished"
    assert_pools_empty(s)
    # every sequence of every request either was aborted or got exactly max_tokens tokens
    for request in (r for family in parents.values() for r in family if r.request_id not in aborted):
        assert request.status == RequestStatus.FINISHED_LENGTH, request
        assert request.num_output_tokens == request.max_tokens, request
    assert s.num_swapped_out_blocks == s.num_swapped_in_blocks + aborted_swapped_blocks
    # the run exercised what it claims to
    assert len(parents) >= 30 and s.num_preemptions > 0 and set(aborted_from) == set(abort_turns)
    assert any(out.copies for out in driver.outputs) and any("#" in rid for rid in driver.sequences)
    if mode == "swap":
        assert s.num_swapped_out_blocks > 0
