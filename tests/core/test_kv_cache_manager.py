"""Slot allocation and prefix caching, driven the way the scheduler drives them, no model."""

import types

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.request import Request

BS = 16


def make_request(request_id, tokens, max_tokens=4):
    return Request(request_id, tokens, types.SimpleNamespace(max_tokens=max_tokens))


def prefill(kv, request):
    """Admit a request the way the scheduler does: take prefix hits, then slots for the rest."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def snapshot(kv):
    pool = kv.pool
    return ({k: list(v) for k, v in kv.req_blocks.items()}, list(pool.ref_cnt),
            list(pool.free_queue), dict(pool.cached))


@pytest.mark.parametrize("num_tokens, num_blocks", [(1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_prompt_takes_one_block_per_started_block_size(num_tokens, num_blocks):
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(num_tokens)))
    new = kv.allocate_slots(request, num_tokens)
    assert len(new) == num_blocks
    assert kv.blocks_of("a") == new
    assert kv.pool.num_free_blocks() == 7 - num_blocks
    kv.check_invariants()


@pytest.mark.parametrize("num_computed, new_blocks", [(15, 0), (16, 1), (31, 0), (32, 1)])
def test_a_decode_step_needs_a_new_block_only_past_a_block_boundary(num_computed, new_blocks):
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(num_computed + 1)))
    kv.allocate_slots(request, num_computed)
    request.num_computed_tokens = num_computed
    held = len(kv.blocks_of("a"))
    assert len(kv.allocate_slots(request, 1)) == new_blocks
    assert len(kv.blocks_of("a")) == held + new_blocks


def test_allocate_slots_when_short_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=BS)   # 4 usable blocks
    prefill(kv, make_request("a", list(range(40))))      # 3 blocks
    before = snapshot(kv)
    big = make_request("b", list(range(100, 140)))
    assert kv.allocate_slots(big, 40) is None
    assert snapshot(kv) == before
    assert "b" not in kv.req_blocks
    # one block is still enough for a small request
    assert len(kv.allocate_slots(make_request("c", [1, 2, 3]), 3)) == 1


def test_second_request_with_the_same_40_token_prefix_reuses_two_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefix = list(range(1000, 1040))
    first = make_request("a", prefix + [1, 2, 3])
    assert prefill(kv, first) == 0
    second = make_request("b", prefix + [7, 8])
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 32
    assert hits == kv.blocks_of("a")[:2]
    free_before = kv.pool.num_free_blocks()
    kv.allocate_slots(second, second.num_tokens - num_hit_tokens, hits)
    # only the partial third block is new
    assert kv.pool.num_free_blocks() == free_before - 1
    assert kv.blocks_of("b")[:2] == hits
    assert [kv.pool.ref_cnt[b] for b in hits] == [2, 2]
    kv.check_invariants()


def test_prefix_hit_is_capped_so_the_last_prompt_token_is_computed():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(32))
    prefill(kv, make_request("a", prompt))
    same = make_request("b", list(prompt))
    hits, num_hit_tokens = kv.get_computed_blocks(same)
    assert num_hit_tokens == 16
    assert hits == kv.blocks_of("a")[:1]
    # one token more and both full blocks can be reused
    longer = make_request("c", prompt + [5])
    assert kv.get_computed_blocks(longer)[1] == 32


def test_hash_chains_the_prefix_so_a_matching_block_after_a_different_one_misses():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    block_a, block_b, block_c = list(range(16)), list(range(16, 32)), list(range(50, 66))
    prefill(kv, make_request("a", block_a + block_b + [0]))
    assert kv.get_computed_blocks(make_request("b", block_c + block_b + [0]))[1] == 0
    assert kv.get_computed_blocks(make_request("c", block_a + block_c + [0]))[1] == 16


def test_get_computed_blocks_changes_nothing():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefill(kv, make_request("a", list(range(40))))
    kv.free(make_request("a", []))
    before = snapshot(kv)
    assert kv.get_computed_blocks(make_request("b", list(range(40))))[1] == 32
    assert snapshot(kv) == before


def test_hit_on_a_freed_but_cached_block_revives_it():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    first = make_request("a", list(range(40)))
    prefill(kv, first)
    cached = kv.blocks_of("a")[:2]
    kv.free(first)
    assert kv.usage() == 0.0
    second = make_request("b", list(range(40)))
    assert prefill(kv, second) == 32
    assert kv.blocks_of("b")[:2] == cached
    assert [kv.pool.ref_cnt[b] for b in cached] == [1, 1]
    assert not set(cached) & set(kv.pool.free_queue)
    assert kv.pool.num_free_blocks() == 5 - 3
    kv.check_invariants()


def test_reviving_cached_blocks_counts_against_free_space():
    kv = KVCacheManager(num_blocks=4, block_size=BS)    # 3 usable blocks
    prefill(kv, make_request("a", list(range(40))))
    kv.free(make_request("a", []))
    holder = make_request("h", [9])
    kv.allocate_slots(holder, 1)                          # evicts a's uncached tail block
    # b would revive 2 cached blocks and need 2 more: 4 > 2 free
    long = make_request("b", list(range(40)) + list(range(200, 220)))
    hits, _ = kv.get_computed_blocks(long)
    assert len(hits) == 2
    before = snapshot(kv)
    assert kv.allocate_slots(long, long.num_tokens - 32, hits) is None
    assert snapshot(kv) == before


def test_freeing_a_request_evicts_its_tail_before_its_prefix():
    kv = KVCacheManager(num_blocks=4, block_size=BS)    # 3 usable blocks
    prefill(kv, make_request("a", list(range(48))))       # 3 full blocks, all cached
    kv.free(make_request("a", []))

    def num_hit_tokens():
        return kv.get_computed_blocks(make_request("q", list(range(48)) + [0]))[1]

    assert num_hit_tokens() == 48
    kv.allocate_slots(make_request("x", [1]), 1)
    assert num_hit_tokens() == 32
    kv.allocate_slots(make_request("y", [1]), 1)
    assert num_hit_tokens() == 16


def test_no_hits_with_caching_off():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    prefill(kv, make_request("a", list(range(40))))
    second = make_request("b", list(range(40)))
    assert kv.get_computed_blocks(second) == ([], 0)
    prefill(kv, second)
    assert not set(kv.blocks_of("a")) & set(kv.blocks_of("b"))
    assert kv.pool.num_free_blocks() == 9 - 6


def test_fork_shares_every_block_with_refcount_two():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_request("p", list(range(20)))
    prefill(kv, parent)
    child = make_request("c", list(range(20)))
    free_before = kv.pool.num_free_blocks()
    kv.fork(parent, child)
    assert kv.blocks_of("c") == kv.blocks_of("p")
    assert [kv.pool.ref_cnt[b] for b in kv.blocks_of("p")] == [2, 2]
    assert kv.pool.num_free_blocks() == free_before
    kv.check_invariants()
    kv.free(parent)
    assert [kv.pool.ref_cnt[b] for b in kv.blocks_of("c")] == [1, 1]
    assert kv.pool.num_free_blocks() == free_before
    kv.free(child)
    assert kv.usage() == 0.0


def test_freeing_everything_returns_usage_to_zero():
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    requests = [make_request(str(i), list(range(i * 7, i * 7 + 5 + 9 * i))) for i in range(4)]
    for request in requests:
        prefill(kv, request)
    assert kv.usage() > 0.0
    for request in requests:
        kv.free(request)
    assert kv.usage() == 0.0
    assert kv.pool.num_free_blocks() == 11
    assert kv.req_blocks == {}
    kv.check_invariants()


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_block_hash_is_sha256_and_the_same_in_another_process():
    import subprocess
    import sys

    from jaxpaged.core.kv_cache_manager import hash_block

    first = hash_block(None, [1, 2, 3, 4])
    second = hash_block(first, [5, 6, 7, 8], None)
    assert isinstance(second, bytes) and len(second) == 32
    # another interpreter (another PYTHONHASHSEED) computes the same chain
    code = ("from jaxpaged.core.kv_cache_manager import hash_block;"
            "print(hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert out == second.hex()
    # the parts never run together: a salt, a parent or another split of the tokens changes the key
    assert len({hash_block(None, [1, 2]), hash_block(None, [1, 2], ""), hash_block(None, [1, 2], "a"),
                hash_block(None, [1, 2], "b"), hash_block(first, [1, 2]), hash_block(None, [1, 2, 0])}) == 6


def test_cache_salt_separates_prefix_cache_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(50))
    salted = Request("a", tokens, types.SimpleNamespace(max_tokens=4), cache_salt="tenant-a")
    assert prefill(kv, salted) == 0
    # same tokens, no salt or another salt: no hit
    assert prefill(kv, Request("b", tokens, types.SimpleNamespace(max_tokens=4))) == 0
    assert prefill(kv, Request("c", tokens, types.SimpleNamespace(max_tokens=4), cache_salt="tenant-b")) == 0
    # same salt: the three full blocks are shared
    again = Request("d", tokens, types.SimpleNamespace(max_tokens=4), cache_salt="tenant-a")
    assert prefill(kv, again) == 48
    assert kv.blocks_of("d")[:3] == kv.blocks_of("a")[:3]
    kv.check_invariants()


def test_a_decode_step_offers_only_newly_filled_blocks_to_the_prefix_cache():
    """Host work per decode step must not grow with the context: 64 cached blocks are offered once,
    then each step offers only a block it filled. The registered prefix still serves a hit."""
    kv = KVCacheManager(num_blocks=100, block_size=BS)
    request = make_request("a", list(range(64 * BS + 3)), max_tokens=40)
    offered = []
    cache = kv.pool.cache
    kv.pool.cache = lambda block, block_hash: (offered.append(block), cache(block, block_hash))
    prefill(kv, request)
    assert len(offered) == 64
    offered.clear()
    for token in range(40):   # decode: the token is known before the next step's slot
        request.append_output_token(token)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    assert offered == kv.blocks_of("a")[64:66]   # blocks 64 and 65 filled during the decode
    kv.check_invariants()
    other = make_request("b", list(range(64 * BS + 3)) + list(range(40)) + [7])
    assert kv.get_computed_blocks(other)[1] == 66 * BS
    kv.free(request)
    assert kv.num_registered == {}
    kv.check_invariants()
