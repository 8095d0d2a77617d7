"""Block moves on the KV pool: copy-on-write copies and swaps through pinned host memory, bit-exact,
with every gather and scatter on device arrays and only whole arrays crossing to the host."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.runner import block_ops
from jaxpaged.runner.block_ops import HostSwapSpace, copy_blocks

SHAPE = (3, 2, 24, 2, 4, 8)   # [layers, 2, blocks, kv_heads, block_size, head_dim]; block 0 unused


def random_pool(seed=0, dtype=jnp.float32):
    # committed, like the pool after the first step (jit's dispatch cache counts committedness)
    return jax.device_put(np.random.default_rng(seed).standard_normal(SHAPE).astype(dtype), jax.devices()[0])


def blocks_of(pool, ids):
    return np.asarray(pool)[:, :, ids]


def pinned_host_arrays():
    gc.collect()
    return [a for a in jax.live_arrays() if a.sharding.memory_kind == "pinned_host"]


def test_swapped_blocks_come_back_bit_exact_from_several_swap_outs_in_any_order():
    pool = random_pool(dtype=jnp.bfloat16)
    space = HostSwapSpace(pool, num_host_blocks=10)
    first, second = [3, 7, 1], [10, 4, 12, 15, 16]          # 3 blocks (bucket 4), 5 blocks (bucket 8)
    space.swap_out(pool, list(zip(first, [5, 2, 9])))
    space.swap_out(pool, list(zip(second, [1, 3, 4, 6, 7])))
    saved = {h: blocks_of(pool, [d])[:, :, 0] for d, h in zip(first + second, [5, 2, 9, 1, 3, 4, 6, 7])}

    pool = jnp.zeros_like(pool) - 1                          # the device blocks are reused meanwhile
    back = [(6, 2), (2, 20), (1, 11), (9, 5)]                # both swap-outs, mixed, into other blocks
    pool = space.swap_in(pool, back)
    assert sorted(space.host_pool) == [3, 4, 5, 7]
    rest = [(7, 1), (4, 3), (5, 23), (3, 9)]
    pool = space.swap_in(pool, rest)

    out = np.asarray(pool)
    for host, device in back + rest:
        np.testing.assert_array_equal(out[:, :, device], saved[host], err_msg=f"host {host} -> device {device}")
    untouched = sorted(set(range(SHAPE[2])) - {d for _, d in back + rest})
    assert (out[:, :, untouched] == -1).all()
    assert space.host_pool == {}


def test_a_reused_host_id_holds_the_new_block_and_a_freed_batch_leaves_host_memory():
    pool = random_pool(1)
    before = len(pinned_host_arrays())
    space = HostSwapSpace(pool, num_host_blocks=4)
    space.swap_out(pool, [(2, 1), (3, 2)])
    space.swap_out(pool, [(5, 1)])                           # the manager gave host 1 again
    assert len(pinned_host_arrays()) == before + 2
    pool = space.swap_in(pool, [(1, 8), (2, 9)])
    np.testing.assert_array_equal(blocks_of(pool, [8, 9]), blocks_of(random_pool(1), [5, 3]))
    assert len(pinned_host_arrays()) == before               # both batches let go


def test_swap_in_of_a_host_block_that_holds_nothing_is_refused():
    pool = random_pool()
    space = HostSwapSpace(pool, num_host_blocks=4)
    space.swap_out(pool, [(2, 1)])
    with pytest.raises(ValueError, match=r"host blocks \[3\]"):
        space.swap_in(pool, [(1, 5), (3, 6)])
    assert list(space.host_pool) == [1]                       # nothing was moved


def test_the_host_side_allocates_nothing_up_front():
    pool = random_pool()
    before = len(jax.live_arrays())
    space = HostSwapSpace(pool, num_host_blocks=1000)
    assert len(jax.live_arrays()) == before and space.host_pool == {} and space.num_host_blocks == 1000


def test_no_host_memory_array_enters_a_jitted_swap_function(monkeypatch):
    seen = []

    def recording(name, fn):
        def wrapper(*args):
            # compiled for exactly these arguments (before the pool is donated): XLA's own view
            compiled = fn.lower(*args).compile()
            kinds = [s.memory_kind for s in (*compiled.input_shardings[0], compiled.output_shardings)]
            assert kinds == ["device"] * len(kinds), (name, kinds)
            assert "S(5)" not in compiled.as_text()            # XLA's host memory space
            kinds = [a.sharding.memory_kind for a in args if isinstance(a, jax.Array)]
            out = fn(*args)
            seen.append((name, kinds + [out.sharding.memory_kind]))
            return out
        return wrapper

    monkeypatch.setattr(block_ops, "_gather_blocks", recording("gather", block_ops._gather_blocks))
    monkeypatch.setattr(block_ops, "_scatter_blocks", recording("scatter", block_ops._scatter_blocks))
    pool = random_pool()
    space = HostSwapSpace(pool, num_host_blocks=8)
    space.swap_out(pool, [(4, 1), (5, 2)])
    space.swap_out(pool, [(6, 3)])
    assert {slot.batch.sharding.memory_kind for slot in space.host_pool.values()} == {"pinned_host"}
    pool = space.swap_in(pool, [(3, 7), (1, 8), (2, 9)])
    assert [name for name, _ in seen] == ["gather", "gather", "scatter", "scatter"]   # one per batch
    assert all(kinds == ["device"] * len(kinds) for _, kinds in seen), seen
    np.testing.assert_array_equal(blocks_of(pool, [7, 8, 9]), blocks_of(random_pool(), [6, 4, 5]))


def test_block_counts_compile_once_per_power_of_two_bucket():
    pool = random_pool(dtype=jnp.float16)                   # a dtype no other test compiles for
    space = HostSwapSpace(pool, num_host_blocks=20)
    gathers, scatters = block_ops._gather_blocks._cache_size(), block_ops._scatter_blocks._cache_size()
    for n, first in ((5, 1), (6, 6), (7, 12)):               # all in the bucket of 8
        space.swap_out(pool, [(b, b) for b in range(first, first + n)])
    for host in (1, 6, 12):
        pool = space.swap_in(pool, [(host, 20)])
    assert block_ops._gather_blocks._cache_size() - gathers == 1
    assert block_ops._scatter_blocks._cache_size() - scatters == 1


def test_copy_blocks_copies_whole_blocks_in_every_layer():
    pool = random_pool(2)
    expected = np.asarray(pool).copy()
    expected[:, :, [9, 10]] = expected[:, :, [3, 3]]
    np.testing.assert_array_equal(np.asarray(copy_blocks(pool, [(3, 9), (3, 10)])), expected)
