"""Which blocks each request holds, prefix-cache lookups, and slot allocation. No arrays.

A request's block table covers its computed tokens plus the ones being computed:

    tokens   | 0 ....... 15 | 16 ...... 31 | 32 .. 37 |           block_size = 16
    blocks   |   b7 (full)  |  b2 (full)   | b9 (partial: 6 of 16 slots used)

Full blocks are hashed by chaining the previous block's hash with their token ids, so a
hash names a whole prefix; the partial last block is never shared by hash. A request's
`cache_salt` enters the first block's hash, so requests with different salts share nothing.
"""

import hashlib
import struct

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.host_cache import HostMoves, HostPrefixCache
from jaxpaged.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: bytes | None, token_ids: tuple[int, ...] | list[int], salt: str | None = None,
               extra: bytes | None = None) -> bytes:
    """SHA-256 of (parent hash, salt, token ids[, extra]): collision-resistant and the same in every
    process. `extra`: the digest of the block's prompt embeddings (a prompt of embeddings' tokens are
    placeholders; these rows are what its K/V is computed from).

    Python's `hash` of a tuple is neither (PYTHONHASHSEED, 64 bits): a collision would hand a
    request another prompt's K/V. Each part is length-prefixed so no two inputs serialize alike.
    """
    digest = hashlib.sha256(parent_hash or b"\x00" * 32)
    salt_bytes = salt.encode() if salt is not None else b""
    digest.update(struct.pack("<?I", salt is not None, len(salt_bytes)) + salt_bytes)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    if extra is not None:
        digest.update(b"embeds" + extra)
    return digest.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_host_blocks: int = 0,
                 rope_switch_len: int = 0, host_cache: HostPrefixCache | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # LongRoPE (ModelConfig.rope_switch_len; 0: none): K/V of a sequence longer than this is encoded
        # with other factors, so such a request's blocks are hashed apart from a shorter one's
        self.rope_switch_len = rope_switch_len
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[int]] = {}
        # the pinned host pool for swapped-out requests (block 0 unused, like the device pool)
        self.host_pool = BlockPool(num_host_blocks + 1, enable_caching=False) if num_host_blocks else None
        self.req_host_blocks: dict[str, list[int]] = {}
        # request id -> how many of its leading blocks were offered to the prefix cache already: each
        # step registers only the blocks filled since (a decode step's host work does not grow with
        # the context). A block whose hash another block holds stays unregistered, as in vLLM.
        self.num_registered: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []   # copy-on-write (src, dst) for the next step
        self.prefix_queries = 0   # tokens looked up in the prefix cache
        self.prefix_hits = 0      # of which found cached
        # bumped by new weights: it enters every first block's hash, so K/V computed by other
        # weights is never found again (requests hashed before keep their own chains)
        self.weights_version = 0
        # the host-memory tier under the prefix cache (kv_offloading_size): what the device cache
        # evicts is kept there, and a device miss that hits it is loaded instead of computed
        self.host_cache = host_cache if enable_caching else None
        if self.host_cache is not None:
            self.pool.evicted = []

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def max_tokens_per_request(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    def _update_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over all full blocks of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        digests = request.prompt_embeds_digests
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            # chained: the first block's salt covers all
            salt = self._salt(request.cache_salt, request.rope_len) if i == 0 else None
            hashes.append(hash_block(parent, request.all_token_ids[i * bs:(i + 1) * bs], salt,
                                     digests[i] if i < len(digests) else None))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks on the device: (block ids, tokens covered). Does not
        change state. Capped so that at least the last token is computed (its logits are needed)."""
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_host_blocks(self, request: Request, num_device_hits: int) -> list[tuple[int, int]]:
        """The host tier's (batch, slot) of the full blocks that follow the device's hits, as far as it
        holds them (the same cap); [] without a tier. Stores what this plan evicted so far first (so
        that it is found too), and changes nothing else."""
        if self.host_cache is None:
            return []
        self._store_evicted()   # what this very plan evicted is found too (loaded from its gather)
        max_blocks = (request.num_tokens - 1) // self.block_size
        refs = []
        for h in request.block_hashes[num_device_hits:max_blocks]:
            ref = self.host_cache.lookup(h)
            if ref is None:
                break
            refs.append(ref)
        return refs

    def cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None,
                             embeds_digests: tuple[bytes, ...] = ()) -> int:
        """Tokens of `token_ids` whose full blocks this cache holds, from the start: on the device, then
        in the host tier as the scheduler would load them (read only: a data-parallel router asks every
        replica before it picks one). `embeds_digests`: a prompt of embeddings' (Request.prompt_embeds_digests)."""
        if not self.enable_caching:
            return 0
        bs, parent, hits, on_host = self.block_size, None, 0, False
        for i in range((len(token_ids) - 1) // bs):
            salt = self._salt(cache_salt, len(token_ids)) if i == 0 else None
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs], salt,
                                embeds_digests[i] if i < len(embeds_digests) else None)
            on_host = on_host or self.pool.lookup(parent) is None
            if on_host and (self.host_cache is None or self.host_cache.lookup(parent) is None):
                break
            hits += bs
        return hits

    def outgrows_rope(self, rope_len: int, num_tokens: int) -> bool:
        """Whether a sequence whose K/V began at `rope_len` tokens must be recomputed at `num_tokens`
        (its rope switched to LongRoPE's long factors in between)."""
        return 0 < rope_len <= self.rope_switch_len < num_tokens

    def _salt(self, cache_salt: str | None, rope_len: int) -> str | None:
        marks = []
        if self.weights_version:
            marks.append(f"weights {self.weights_version}")
        if 0 < self.rope_switch_len < rope_len:
            marks.append("long rope")
        if not marks:
            return cache_salt
        return "\x00".join([cache_salt or "", *marks])

    def reset_prefix_cache(self, new_weights: bool = False) -> None:
        """Forget every cached block that no request holds (changes state); with `new_weights`, also
        stop every block computed so far from being found again (their K/V belongs to the old weights)."""
        if new_weights:
            self.weights_version += 1
        self.pool.reset_prefix_cache()
        if self.host_cache is not None:
            self.pool.evicted = []
            self.host_cache.clear()

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_blocks: int = 0) -> int:
        total = request.num_computed_tokens + num_new_computed_blocks * self.block_size + num_new_tokens
        held = len(self.req_blocks.get(request.request_id, ()))
        return max(0, cdiv(total, self.block_size) - held - num_new_computed_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`; changes state.

        `new_computed_blocks` are prefix-cache hits the request takes over first. Returns the
        newly allocated block ids, or None (and changes nothing) when there is no room.
        """
        new_computed_blocks = new_computed_blocks or []
        needed = self.num_blocks_needed(request, num_new_tokens, len(new_computed_blocks))
        # hits with ref_cnt 0 sit in the free queue: reviving them consumes free blocks too
        revived = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0) if new_computed_blocks else 0
        shared_tail = self._shared_write_block(request) if num_new_tokens else None
        if needed + revived + (shared_tail is not None) > self.pool.num_free_blocks():
            return None
        if shared_tail is not None:
            self._copy_on_write(request, shared_tail)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(needed) if needed else []
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, request.num_computed_tokens
                                + len(new_computed_blocks) * self.block_size + num_new_tokens)
        return new_blocks

    def begin_load(self, request: Request, hits: list[int], host_blocks: list[tuple[int, int]]) -> bool:
        """Take the device's prefix hits and a fresh block for each of the host tier's (batch, slot)
        hits after them, loaded after this step's forward: the request runs from the next plan on,
        when its next allocation adds the loaded blocks to the device cache (their K/V has landed
        before any later step reads them). Changes state; False (and nothing changed) when the
        pool is short."""
        revived = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        if len(host_blocks) + revived > self.pool.num_free_blocks():
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        self.pool.touch(hits)
        blocks.extend(hits)
        loaded = self.pool.allocate(len(host_blocks))
        self.host_cache.take(host_blocks, loaded)
        blocks.extend(loaded)
        self.num_registered[request.request_id] = len(hits)
        return True

    def release_loaded(self, request: Request) -> None:
        """Let a loaded request's blocks go, their K/V landed: into the device cache, for its next try."""
        self._cache_full_blocks(request, request.num_computed_tokens)
        self.free(request)

    def take_host_moves(self) -> HostMoves | None:
        """The host tier's stores (of what the device cache evicted since the last plan), loads and
        drops for the next step; None without a tier or without any."""
        if self.host_cache is None:
            return None
        self._store_evicted()
        return self.host_cache.take_moves()

    def _store_evicted(self) -> None:
        if self.pool.evicted:
            self.host_cache.store(self.pool.evicted)
            self.pool.evicted = []

    def _shared_write_block(self, request: Request) -> int | None:
        """Index (in the block table) of a shared, partially filled block the next token lands in."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks or request.num_computed_tokens % self.block_size == 0:
            return None
        i = request.num_computed_tokens // self.block_size
        if i < len(blocks) and self.pool.ref_cnt[blocks[i]] > 1:
            return i
        return None

    def _copy_on_write(self, request: Request, index: int) -> None:
        """Give the request a private copy of block `index` (the copy runs on device before the step).

            before:  req A ─┐            after:  req A ── b5
                     req B ─┴─ b5 (2)            req B ── b9 (copy of b5)
        """
        blocks = self.req_blocks[request.request_id]
        (fresh,) = self.pool.allocate(1)
        self.pending_copies.append((blocks[index], fresh))
        self.pool.free([blocks[index]])
        blocks[index] = fresh

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- swapping to the host pool ---------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        n = len(self.req_blocks.get(request.request_id, ()))
        return self.host_pool is not None and n > 0 and self.host_pool.can_allocate(n)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to host blocks; returns (device, host) pairs to copy. Changes state."""
        blocks = self.req_blocks.pop(request.request_id)
        self.num_registered.pop(request.request_id, None)   # swapped back in, it holds other blocks
        host_blocks = self.host_pool.allocate(len(blocks))
        self.req_host_blocks[request.request_id] = host_blocks
        self.pool.free(list(reversed(blocks)))
        return list(zip(blocks, host_blocks))

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back; returns (host, device) pairs, or None if the pool is short."""
        host_blocks = self.req_host_blocks[request.request_id]
        blocks = self.pool.allocate(len(host_blocks))
        if blocks is None:
            return None
        del self.req_host_blocks[request.request_id]
        self.host_pool.free(host_blocks)
        self.req_blocks[request.request_id] = blocks
        return list(zip(host_blocks, blocks))

    def num_swapped_blocks(self, request: Request) -> int:
        return len(self.req_host_blocks.get(request.request_id, ()))

    def host_usage(self) -> float:
        return self.host_pool.usage() if self.host_pool is not None else 0.0

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every block fully covered by the first `num_tokens` tokens.

        Safe before the step runs: within a step every layer writes its K/V before any
        attention reads the pool, so a same-step hit reads finished entries.
        """
        rid = request.request_id
        start = self.num_registered.get(rid, 0)
        if not self.enable_caching or num_tokens // self.block_size <= start:   # no block filled (most decodes)
            return
        self._update_hashes(request)
        blocks = self.req_blocks[rid]
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache(blocks[i], request.block_hashes[i])
        if end > start:
            self.num_registered[rid] = end

    def forget_cached_blocks(self, blocks: list[int]) -> None:
        """Drop these blocks from the prefix cache (their K/V is not trusted); changes state."""
        self.pool.uncache(blocks)

    def free(self, request: Request) -> None:
        """Release all blocks of a request (tail first, so its tail is evicted before its prefix)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_registered.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
        host_blocks = self.req_host_blocks.pop(request.request_id, [])
        if host_blocks:
            self.host_pool.free(host_blocks)

    def fork(self, parent: Request, child: Request) -> None:
        """Child shares all of the parent's blocks by refcount (copy-on-write happens on write)."""
        blocks = list(self.req_blocks.get(parent.request_id, []))
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = blocks
        child.block_hashes = list(parent.block_hashes)

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.req_blocks)
        assert self.num_registered.keys() <= self.req_blocks.keys(), "registration marks of released requests"
        if self.host_pool is not None:
            self.host_pool.check_invariants(self.req_host_blocks)
        if self.host_cache is not None:
            self.host_cache.check_invariants()
