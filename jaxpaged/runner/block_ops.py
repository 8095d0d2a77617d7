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
import logging
import time
from typing import NamedTuple

import jax
import numpy as np

from jaxpaged.runner.batch_builder import next_bucket

logger = logging.getLogger(__name__)


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


def _scatter_slots(kv_pool: jax.Array, blocks: jax.Array, slots: list[tuple[int, int]]) -> jax.Array:
    """kv_pool with device block d := slot s of `blocks` (a batch on the device) for each (s, d); donated."""
    src, dst = _padded(slots, 0, kv_pool.shape[2], size=blocks.shape[2])
    return _scatter_blocks(kv_pool, blocks, src, dst)


def _round_trip_to_nowhere(kv_pool: jax.Array, size: int, space) -> jax.Array:
    """`size` blocks to pinned host memory and back, scattered out of bounds (nothing written): what a
    swap or the host tier runs, at one bucket size. Returns the pool (donated)."""
    src, dst = np.zeros(size, np.int32), np.full(size, kv_pool.shape[2], np.int32)
    batch = jax.device_put(_gather_blocks(committed(kv_pool), src), space.host_sharding)
    return _scatter_blocks(committed(kv_pool), jax.device_put(batch, space.device_sharding), src, dst)


def warm_up_block_moves(kv_pool: jax.Array, sizes: list[int],
                        swap_space: "HostSwapSpace | HostCacheSpace | None") -> jax.Array:
    """Compile the copy (and swap or host tier) ops for each bucket size by running them, through the
    same transfers as a real swap, on nothing: every destination is out of bounds. Returns the pool (donated)."""
    nowhere = kv_pool.shape[2]
    kv_pool = committed(kv_pool)
    for size in sizes:
        src, dst = np.zeros(size, np.int32), np.full(size, nowhere, np.int32)
        kv_pool = _copy(kv_pool, src, dst)
        if swap_space is not None:
            kv_pool = _round_trip_to_nowhere(kv_pool, size, swap_space)
    return kv_pool


def time_round_trip(kv_pool: jax.Array, size: int, space: "HostSwapSpace") -> tuple[jax.Array, float]:
    """Seconds of `size` blocks to pinned host memory and back (written nowhere), timed after a first
    round trip compiles the ops; returns the pool (donated) and the seconds."""
    for _ in range(2):
        start = time.perf_counter()
        kv_pool = _round_trip_to_nowhere(kv_pool, size, space)
        kv_pool.block_until_ready()
        seconds = time.perf_counter() - start
    return kv_pool, seconds


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
            kv_pool = _scatter_slots(kv_pool, blocks, slots)
        return kv_pool


class HostCacheSpace:
    """The bytes of the prefix cache's host tier (core/host_cache.py holds which hash is where):
    one batch in pinned host memory per store, as swapped-out blocks are held.

    A plan's moves come in two parts. Before its forward, its stores are gathered on the device
    (the blocks they read are reused by this very step). After its forward, its loads are
    scattered into the pool (from a host batch, or straight from a batch gathered in this plan:
    the requests they serve compute from the next step on, so a load's copy overlaps the forward
    rather than holding it up), its drops let batches go, and only then do its stores go to host
    memory: the tier's host memory never holds more than its capacity."""

    def __init__(self, kv_pool: jax.Array | jax.ShapeDtypeStruct):
        self.device_sharding = kv_pool.sharding.with_memory_kind("device")
        self.host_sharding = kv_pool.sharding.with_memory_kind("pinned_host")
        self.batches: dict[int, jax.Array] = {}     # batch id -> [layers, 2, bucket, ...] in pinned_host
        self.gathered: dict[int, jax.Array] = {}    # this plan's stores, on the device until `load`
        # loads that failed since `take_failed` (a batch missing, a transfer refused): their requests
        # recompute instead, and their batches are forgotten
        self.failed_blocks: set[int] = set()
        self.failed_batches: set[int] = set()

    def gather(self, kv_pool: jax.Array, moves) -> None:
        """Before the forward: the plan's stores, gathered from the pool (HostMoves.stores)."""
        for batch, blocks in moves.stores:
            self.gathered[batch] = _gather_blocks(kv_pool, _padded([(b, 0) for b in blocks], 0, 0)[0])

    def load(self, kv_pool: jax.Array, moves) -> jax.Array:
        """After the forward: the plan's loads, drops, and its stores' copies to host memory.
        Returns the new pool (the old one is donated)."""
        by_batch: dict[int, list[tuple[int, int]]] = {}
        for batch, slot, block in moves.loads:
            by_batch.setdefault(batch, []).append((slot, block))
        for batch, slots in by_batch.items():
            try:
                source = self.gathered.get(batch)
                if source is None:
                    source = jax.device_put(self.batches[batch], self.device_sharding)
            except Exception as exc:   # noqa: BLE001 -- the blocks are recomputed instead
                logger.warning("host tier: loading batch %d failed (%s: %s); its requests recompute", batch,
                               type(exc).__name__, exc)
                self.failed_blocks.update(block for _, block in slots)
                self.failed_batches.add(batch)
                self.batches.pop(batch, None)
                continue
            kv_pool = _scatter_slots(kv_pool, source, slots)
        for batch in moves.drops:
            self.batches.pop(batch, None)
            self.gathered.pop(batch, None)
        for batch, blocks in self.gathered.items():
            self.batches[batch] = jax.device_put(blocks, self.host_sharding)
        self.gathered = {}
        return kv_pool

    def take_failed(self) -> tuple[set[int], set[int]]:
        """(device blocks, batch ids) of the loads that failed since the last call."""
        failed = self.failed_blocks, self.failed_batches
        self.failed_blocks, self.failed_batches = set(), set()
        return failed

    def num_slots(self) -> int:
        """Block slots the tier's batches hold in host memory (padding included)."""
        return sum(batch.shape[2] for batch in self.batches.values())
