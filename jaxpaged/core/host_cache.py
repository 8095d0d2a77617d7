"""The prefix cache's second tier: full blocks that left the device's cache, kept in host memory
under their hashes (`kv_offloading_size`, `kv_offloading_backend="native"`). No arrays here:
which hash sits where; the runner holds the bytes (runner/block_ops.HostCacheSpace).

    device cache evicts b7 (hash h) ──store──> host batch 12, slot 3      (h -> (12, 3))
    a later request misses h on the device ──lookup──> (12, 3) ──load──> a fresh device block

Blocks are stored as the runner moves them: a step's evictions in batches of at most
`max_batch` blocks, each one gather and one copy to host memory, padded to its bucket
(`padded(n)` slots). Memory is accounted in those slots and freed by whole batches, the least
recently used first (a hit refreshes its batch): what the tier holds never exceeds `capacity`
slots. A hash stored once is not stored again while it is held (a hit refreshes it instead).
"""

from collections import OrderedDict
from typing import Callable, NamedTuple

KV_OFFLOADING_BACKENDS = ("native",)


class HostMoves(NamedTuple):
    """The tier's part of a plan, in the order the runner applies it (runner/block_ops.HostCacheSpace)."""
    stores: list[tuple[int, list[int]]]      # (batch id, device blocks): gathered before the step's forward
    loads: list[tuple[int, int, int]]        # (batch id, slot, device block): copied in after the forward
    drops: list[int]                         # batch ids let go (after the loads)


class HostPrefixCache:
    def __init__(self, capacity: int, padded: Callable[[int], int], max_batch: int):
        if capacity < 1:
            raise ValueError(f"the host tier must hold at least one block, got {capacity}")
        self.capacity = capacity
        self.padded = padded
        self.max_batch = max_batch
        self.batches: OrderedDict[int, list[bytes]] = OrderedDict()   # least recently used first
        self.slots_of: dict[int, int] = {}
        self.where: dict[bytes, tuple[int, int]] = {}                 # hash -> (batch id, slot)
        self.used = 0
        self._next_id = 1
        self._stores: list[tuple[int, list[int]]] = []
        self._loads: list[tuple[int, int, int]] = []
        self._drops: list[int] = []
        self.queries = 0    # tokens looked up here after a device miss
        self.hits = 0       # of which found

    def __len__(self) -> int:
        return len(self.where)

    def lookup(self, block_hash: bytes) -> tuple[int, int] | None:
        return self.where.get(block_hash)

    def take(self, refs: list[tuple[int, int]], device_blocks: list[int]) -> None:
        """Load these (batch, slot) refs into the device blocks in the next step; refreshes their batches."""
        for (batch, slot), block in zip(refs, device_blocks):
            self.batches.move_to_end(batch)
            self._loads.append((batch, slot, block))

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def store(self, evicted: list[tuple[int, bytes]]) -> None:
        """Keep these (device block, hash) pairs, which the device cache just evicted; their bytes
        are gathered before the step that reuses the blocks writes them."""
        fresh: dict[bytes, int] = {}
        for block, block_hash in evicted:
            held = self.where.get(block_hash)
            if held is not None:
                self.batches.move_to_end(held[0])
            else:
                fresh.setdefault(block_hash, block)
        items = list(fresh.items())
        for i in range(0, len(items), self.max_batch):
            chunk = items[i:i + self.max_batch]
            slots = self.padded(len(chunk))
            if slots > self.capacity:
                continue
            while self.used + slots > self.capacity:
                self._drop(next(iter(self.batches)))
            batch, self._next_id = self._next_id, self._next_id + 1
            self.batches[batch] = [h for h, _ in chunk]
            self.slots_of[batch] = slots
            self.used += slots
            for slot, (block_hash, _) in enumerate(chunk):
                self.where[block_hash] = (batch, slot)
            self._stores.append((batch, [block for _, block in chunk]))

    def _drop(self, batch: int) -> None:
        for block_hash in self.batches.pop(batch):
            if self.where.get(block_hash, (None,))[0] == batch:
                del self.where[block_hash]
        self.used -= self.slots_of.pop(batch)
        self._drops.append(batch)

    def forget(self, batches) -> None:
        """Forget these batches (their loads failed: the runner no longer holds them)."""
        for batch in batches:
            if batch in self.batches:
                self._drop(batch)

    def clear(self) -> None:
        """Forget every block (reset_prefix_cache; new weights: the K/V belongs to the old ones)."""
        for batch in list(self.batches):
            self._drop(batch)

    def take_moves(self) -> HostMoves | None:
        """The stores, loads and drops since the last call; None when there are none."""
        if not (self._stores or self._loads or self._drops):
            return None
        moves = HostMoves(self._stores, self._loads, self._drops)
        self._stores, self._loads, self._drops = [], [], []
        return moves

    def check_invariants(self) -> None:
        assert self.used == sum(self.slots_of.values()) <= self.capacity
        assert self.batches.keys() == self.slots_of.keys()
        for block_hash, (batch, slot) in self.where.items():
            assert self.batches[batch][slot] == block_hash
