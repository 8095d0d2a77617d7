"""Whole-block moves on the KV pool: copy-on-write copies, swap out to / swap in from pinned host memory.

A block id names the same block in every layer, so each move is one gather and one
scatter over axis 2 of the pool ([layers, 2, blocks, kv_heads, block_size, head_dim]).
The number of blocks moved is padded to a power of two so each op compiles once per
bucket; padded entries gather block 0 and scatter out of bounds, where they are dropped.

Every gather and scatter runs on the device, on device arrays: inside a jit, XLA on a GPU
either cannot index arrays in host memory or does it across PCIe element by element. Host
memory only receives and gives back whole arrays through `jax.device_put`, one DMA each:

    swap-out  pool --gather--> blocks [L, 2, bucket, ...] --device_put--> batch in pinned_host
    swap-in   batch in pinned_host --device_put--> device copy --scatter--> pool (donated)

So there is no host pool array and nothing is allocated up front: a host block is a slot of
the batch written by the swap-out that filled it, and the KV cache manager keeps the number of
held host blocks within `num_host_blocks`. A slot is let go when swapped in, or when the manager
hands its host id to a later swap-out (how an aborted request's blocks go); a batch is freed with
its last slot. Host memory is therefore the live batches: each padded to its bucket (under twice
its blocks), and one partly swapped in stays whole until the rest of it is.
"""

import functools
from typing import NamedTuple

import jax
import numpy as np

from jaxpaged.runner.batch_builder import next_bucket


def _padded(pairs: list[tuple[int, int]], src_pad: int, dst_pad: int,
            size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    size = size or next_bucket(len(pairs), 4)
    src = np.full(size, src_pad, np.int32)
    dst = np.full(size, dst_pad, np.int32)
    if pairs:
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
    return src, dst


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy(kv_pool, src, dst):
    return kv_pool.at[:, :, dst].set(kv_pool[:, :, src], mode="drop")


def copy_blocks(kv_pool: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
    """kv_pool with block dst := block src for each (src, dst); pool donated."""
    src, dst = _padded(pairs, 0, kv_pool.shape[2])
    return _copy(kv_pool, src, dst)


@jax.jit
def _gather_blocks(kv_pool, block_ids):
    return kv_pool[:, :, block_ids]                # [layers, 2, bucket, kv_heads, block_size, head_dim]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_blocks(kv_pool, blocks, src, dst):
    # blocks: [layers, 2, bucket, kv_heads, block_size, head_dim]; src, dst: i32[bucket]
    return kv_pool.at[:, :, dst].set(blocks[:, :, src], mode="drop")


def warm_up_block_moves(kv_pool: jax.Array, sizes: list[int], swap_space: "HostSwapSpace | None") -> jax.Array:
    """Compile the copy (and swap) ops for each bucket size by running them, through the same
    transfers as a real swap, on nothing: every destination is out of bounds. Returns the pool (donated)."""
    nowhere = kv_pool.shape[2]
    kv_pool = committed(kv_pool)
    for size in sizes:
        src, dst = np.zeros(size, np.int32), np.full(size, nowhere, np.int32)
        kv_pool = _copy(kv_pool, src, dst)
        if swap_space is not None:
            batch = jax.device_put(_gather_blocks(kv_pool, src), swap_space.host_sharding)
            kv_pool = _scatter_blocks(kv_pool, jax.device_put(batch, swap_space.device_sharding), src, dst)
    return kv_pool


def committed(kv_pool: jax.Array) -> jax.Array:
    """The pool committed to its device (no copy). jit keys its cache on committedness: a compiled
    step returns the pool uncommitted, a swap-in's scatter commits it; the block moves always
    take it committed, so each of their buckets compiles once."""
    return jax.device_put(kv_pool, kv_pool.sharding)


class HostBlock(NamedTuple):
    """Where a swapped-out block lives: slot `index` of one swap-out's batch in pinned host memory."""
    batch: jax.Array   # [layers, 2, bucket, kv_heads, block_size, head_dim], memory kind pinned_host
    index: int


class HostSwapSpace:
    """Host blocks in pinned host memory and the two transfers between them and the device pool."""

    def __init__(self, kv_pool: jax.Array | jax.ShapeDtypeStruct, num_host_blocks: int):
        """kv_pool: the pool, or its description before it is allocated (only its sharding is read)."""
        self.num_host_blocks = num_host_blocks
        self.device_sharding = kv_pool.sharding.with_memory_kind("device")
        self.host_sharding = kv_pool.sharding.with_memory_kind("pinned_host")
        self.host_pool: dict[int, HostBlock] = {}     # host block id (from the KV cache manager) -> its slot

    def swap_out(self, kv_pool: jax.Array, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks ((device, host) pairs). Changes state: a host id
        swapped out to again forgets what it held."""
        device_ids, _ = _padded(pairs, 0, 0)
        batch = jax.device_put(_gather_blocks(kv_pool, device_ids), self.host_sharding)
        for index, (_, host_id) in enumerate(pairs):
            self.host_pool[host_id] = HostBlock(batch, index)

    def swap_in(self, kv_pool: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
        """Copy host blocks back into device blocks ((host, device) pairs, in any order, from any
        earlier swap-outs); returns the new pool (the old one is donated). Changes state: the host
        blocks are let go."""
        missing = [host_id for host_id, _ in pairs if host_id not in self.host_pool]
        if missing:
            raise ValueError(f"swap_in: host blocks {missing} hold nothing (never swapped out, or already "
                             "swapped in)")
        # usually one batch: a request swapped out alone comes back whole. A batch that also holds
        # other requests' blocks still travels whole: a DMA of it beats gathering it through the CPU.
        moves: dict[int, tuple[jax.Array, list[tuple[int, int]]]] = {}   # id(batch) -> (batch, (slot, device))
        for host_id, device_id in pairs:
            batch, index = self.host_pool.pop(host_id)
            moves.setdefault(id(batch), (batch, []))[1].append((index, device_id))
        batches = [batch for batch, _ in moves.values()]
        for blocks, (_, slots) in zip(jax.device_put(batches, self.device_sharding), moves.values()):
            src, dst = _padded(slots, 0, kv_pool.shape[2], size=blocks.shape[2])
            kv_pool = _scatter_blocks(kv_pool, blocks, src, dst)
        return kv_pool
