"""The pool of KV blocks: reference counts, an LRU free queue and the prefix cache.

A block is in one of three states: in use (ref_count > 0); free and cached (ref_count == 0, still
holding a hash, reusable by a later request with the same prefix until it is evicted); free and
empty. Free blocks wait in one LRU queue; allocation takes from its head, evicting the cached
content of the block it takes. Requests release their blocks tail first, so a prompt's last blocks
are evicted before its first ones (the first are the ones other prompts share).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from cluster.kv.hashing import BlockHash
from cluster.kv.kv_events import KVEventLog, KVTier


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 on_allocate: Callable[[list[int]], None] | None = None, events: KVEventLog | None = None):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Counters for metrics: prompt blocks looked up / found in the cache.
        self.queries = 0
        self.hits = 0
        self.on_allocate = on_allocate   # called with newly allocated block ids (per-block side state resets)
        self.on_cached = None     # called with (block, key) when a block is published (KV tiers copy it down)
        self.events = events      # a KVEventLog (cluster/kv/kv_events.py): keys stored and evicted, for the router

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def match_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (does not take them)."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    # --- ownership -----------------------------------------------------------------------
    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks a new request reuses."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise NoFreeBlocks(f"need {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            out.append(b)
        if self.on_allocate is not None:
            self.on_allocate(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block; pass a request's blocks in reverse token order."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than taken")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None

    def cache_block(self, block: int, block_hash: BlockHash) -> None:
        """Publish a full block under its key. If another block already holds the same content
        the first one stays canonical and this one stays private (it is freed normally)."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(KVTier.POOL, block_hash)
        if self.on_cached is not None:
            self.on_cached(block, block_hash)

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.ref_counts[b] == 0:
                self._evict(b)

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.events is not None:
                    self.events.removed(KVTier.POOL, h)

    def check_idle(self) -> None:
        """Raise if any block is still referenced: every request has released what it took."""
        held = [i for i, r in enumerate(self.ref_counts) if r]
        if held or len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"blocks still held: {held[:10]} ({len(held)} in all)")
