"""The block pool as the KV cache manager sees it: refcounts, the null block, LRU eviction
of cached free blocks, and refusals that leave the pool untouched."""

import pytest

from jaxpaged.core.block_pool import BlockPool


def snapshot(pool: BlockPool):
    return (list(pool.ref_cnt), list(pool.free_queue), dict(pool.cached), list(pool.block_hash))


def test_fresh_pool_has_every_block_but_the_null_block_free():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.num_free_blocks() == 4
    assert pool.usage() == 0.0
    pool.check_invariants({})


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_too_small_pool_is_rejected(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert sorted(blocks) == [1, 2, 3]
    assert pool.allocate(1) is None
    pool.free(blocks)
    # churn through the pool a few times: block 0 must never come back
    for _ in range(5):
        again = pool.allocate(3)
        assert 0 not in again
        pool.free(again)


def test_allocate_free_and_touch_keep_refcounts():
    pool = BlockPool(6)
    a = pool.allocate(2)
    assert [pool.ref_cnt[b] for b in a] == [1, 1]
    assert pool.num_free_blocks() == 3
    assert pool.usage() == pytest.approx(2 / 5)

    pool.touch(a)                      # a second holder (a fork or a prefix hit)
    assert [pool.ref_cnt[b] for b in a] == [2, 2]
    pool.check_invariants({"x": a, "y": a})

    pool.free(a)                       # one holder leaves: blocks stay in use
    assert [pool.ref_cnt[b] for b in a] == [1, 1]
    assert pool.num_free_blocks() == 3
    pool.check_invariants({"x": a})

    pool.free(a)
    assert pool.num_free_blocks() == 5
    assert pool.usage() == 0.0
    pool.check_invariants({})


def test_allocate_when_short_returns_none_and_changes_nothing():
    pool = BlockPool(5)
    held = pool.allocate(2)
    pool.cache(held[0], 111)
    pool.free(held[:1])                # a cached free block sits in the LRU
    before = snapshot(pool)
    assert pool.allocate(4) is None
    assert snapshot(pool) == before
    assert pool.lookup(111) == held[0]


def test_allocate_zero_blocks_is_a_no_op():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks() == 2


def test_double_free_raises():
    pool = BlockPool(4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks)


def test_freeing_a_never_allocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.free([2])
    with pytest.raises(RuntimeError):
        pool.free([0])


def test_eviction_takes_the_oldest_freed_cached_block_first_and_drops_its_hash():
    pool = BlockPool(4)
    b1, b2, b3 = pool.allocate(3)
    for block, h in ((b1, 101), (b2, 102), (b3, 103)):
        pool.cache(block, h)
    # freed in the order b2, b3, b1: b2 is the least recently used
    pool.free([b2])
    pool.free([b3])
    pool.free([b1])
    assert {pool.lookup(h) for h in (101, 102, 103)} == {b1, b2, b3}

    assert pool.allocate(1) == [b2]
    assert pool.lookup(102) is None
    assert pool.block_hash[b2] is None
    assert pool.lookup(101) == b1 and pool.lookup(103) == b3

    assert pool.allocate(1) == [b3]
    assert pool.lookup(103) is None
    assert pool.lookup(101) == b1
    pool.check_invariants({"x": [b2, b3]})


def test_touch_revives_a_cached_free_block_and_removes_it_from_the_lru():
    pool = BlockPool(4)
    b1, b2, b3 = pool.allocate(3)
    pool.cache(b1, 7)
    pool.free([b1, b2, b3])
    pool.touch([pool.lookup(7)])
    assert pool.ref_cnt[b1] == 1
    assert pool.num_free_blocks() == 2
    # the revived block is no longer a candidate for eviction
    assert sorted(pool.allocate(2)) == sorted([b2, b3])
    assert pool.allocate(1) is None
    assert pool.lookup(7) == b1
    pool.check_invariants({"x": [b1], "y": [b2, b3]})


def test_a_block_freed_again_moves_to_the_back_of_the_lru():
    pool = BlockPool(4)
    b1, b2, b3 = pool.allocate(3)
    pool.free([b1, b2, b3])
    pool.touch([b1])
    pool.free([b1])                    # b1 is now the most recently used
    assert pool.allocate(2) == [b2, b3]
    assert pool.allocate(1) == [b1]


def test_cache_keeps_the_first_block_for_a_hash():
    pool = BlockPool(4)
    b1, b2 = pool.allocate(2)
    pool.cache(b1, 5)
    pool.cache(b2, 5)
    assert pool.lookup(5) == b1
    assert pool.block_hash[b2] is None
    # and a block keeps the hash it was first registered under
    pool.cache(b1, 6)
    assert pool.lookup(6) is None
    assert pool.block_hash[b1] == 5


def test_caching_off_never_finds_anything():
    pool = BlockPool(4, enable_caching=False)
    b1 = pool.allocate(1)[0]
    pool.cache(b1, 9)
    assert pool.lookup(9) is None
    assert pool.block_hash[b1] is None


def test_reset_prefix_cache_forgets_free_blocks_only():
    pool = BlockPool(4)
    b1, b2 = pool.allocate(2)
    pool.cache(b1, 1)
    pool.cache(b2, 2)
    pool.free([b1])
    pool.reset_prefix_cache()
    assert pool.lookup(1) is None
    assert pool.lookup(2) == b2      # still held by a request: its contents are live


def test_check_invariants_catches_a_refcount_that_disagrees_with_holders():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_invariants({"x": blocks[:1]})
    with pytest.raises(AssertionError):
        pool.check_invariants({"x": blocks + [0]})
