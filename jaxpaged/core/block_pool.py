"""The device block pool: refcounts, a free queue that is also the LRU of cached blocks,
and a hash -> block map for prefix caching. Plain Python, no arrays.

Block 0 is the null block: padding in block tables points at it; it is never handed out.

A block with ref_cnt 0 sits in the free queue. If it still carries a hash it can be
revived by a prefix-cache hit (`touch`) until `allocate` evicts it (oldest first), at which
point its hash is dropped.
"""

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # insertion order = eviction order; values unused
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}   # block hash -> block id
        # (block, hash) of cached blocks `allocate` evicted, for a host tier to keep (None: not tracked)
        self.evicted: list[tuple[int, bytes]] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_usable_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks (ref_cnt 1), evicting cached ones LRU-first; None if fewer are free."""
        if n > len(self.free_queue):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            if self.evicted is not None and self.block_hash[block] is not None:
                self.evicted.append((block, self.block_hash[block]))
            self._drop_hash(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free_queue[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in the given order."""
        for block in blocks:
            if self.ref_cnt[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free_queue[block] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a full block under its hash (keeps the first block seen for a hash)."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def uncache(self, blocks: list[int]) -> None:
        """Unregister the blocks' hashes; the blocks themselves stay where they are."""
        for block in blocks:
            self._drop_hash(block)

    def _drop_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def reset_prefix_cache(self) -> None:
        for block in list(self.free_queue):
            self._drop_hash(block)

    def check_invariants(self, held: dict[str, list[int]]) -> None:
        """For tests: refcounts equal the number of holders; free queue = blocks with no holder."""
        counts = [0] * self.num_blocks
        for blocks in held.values():
            for b in blocks:
                counts[b] += 1
        assert counts[0] == 0, "the null block was handed out"
        assert counts == self.ref_cnt, "refcounts disagree with the block tables"
        free = {b for b in range(1, self.num_blocks) if counts[b] == 0}
        assert free == set(self.free_queue), "free queue disagrees with refcounts"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h
