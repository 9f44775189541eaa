"""Routing policies: which prefill worker computes a prompt and which decode worker continues it.

All share one interface and see the same live view of the workers (`WorkerView`: in-flight
requests counted by the router itself, KV usage from the workers' periodic stats). The default,
`PrefixAwarePolicy`, prefers the prefill worker that already caches most of the prompt's blocks,
keyed by the very block hashes the workers' pools use, traded against its queue. What a worker
caches is tracked approximately from what the router sent it (bounded LRU), with no RPC per request.

Several frontends (`--frontends N`) each keep their own view, so memory alone would send one
prefix to different workers. The policy therefore also gives every prompt a home worker that any
frontend computes alike: rendezvous hashing of the prompt's affinity block (its block at
`affinity_blocks`, or its last full block) over the healthy workers. A prompt no view knows goes
home, unless home is far busier than the average (consistent hashing with bounded loads).
"""
from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from cluster.kv.hashing import BlockHash
from router.kv_index import ClusterKVIndex


# A cached block in a tier below the pool saves its prefill but costs a copy: worth a little less
# than one in the pool (a host copy takes microseconds per block, a disk read tens of them).
HOST_BLOCK_WEIGHT = 0.9
DISK_BLOCK_WEIGHT = 0.7


@dataclass
class WorkerView:
    name: str
    role: str
    in_flight: int = 0
    blocks_free: int = 0
    blocks_total: int = 1
    running: int = 0
    healthy: bool = True
    cached: OrderedDict = field(default_factory=OrderedDict)   # block hash -> when last sent, LRU order
    cache_capacity: int = 1 << 16
    index: ClusterKVIndex | None = None     # the workers' own KV events, when the router reads them

    def cached_prefix(self, hashes: list[BlockHash]) -> float:
        """The prompt's leading blocks this worker would not compute: with the KV index, what the
        worker says it holds, a block in a tier below the pool counted for a little less (it has to
        be loaded); a worker whose events stopped counts as holding nothing (load decides). Without
        the index, or before its first read of this worker (the cluster starting, a restarted
        worker): the router's own record of what it sent the worker."""
        if self.index is None or not self.index.has_heard(self.name):
            return self._sent_since(hashes)
        c = self.index.cached(self.name, hashes)
        score = c.pool + HOST_BLOCK_WEIGHT * (c.host - c.pool) + DISK_BLOCK_WEIGHT * (c.disk - c.host)
        since = self.index.heard_at(self.name)
        if since is not None:     # what this router sent it after that read is not in the events yet
            score = max(score, self._sent_since(hashes, since))
        return score

    def _sent_since(self, hashes: list[BlockHash], since: float = float("-inf")) -> int:
        """Leading blocks of `hashes` this router sent the worker at `since` or later."""
        n = 0
        for h in hashes:
            at = self.cached.get(h)
            if at is None or at < since:
                break
            n += 1
        return n

    def remember(self, hashes: list[BlockHash]) -> None:
        now = time.monotonic()
        for h in hashes:
            self.cached[h] = now
            self.cached.move_to_end(h)
        while len(self.cached) > self.cache_capacity:
            self.cached.popitem(last=False)


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self):
        self._counters: dict[str, itertools.count] = {}

    def _next(self, role: str, workers: list[WorkerView]) -> WorkerView:
        c = self._counters.setdefault(role, itertools.count())
        return workers[next(c) % len(workers)]

    def choose_prefill(self, hashes, workers):
        return self._next("prefill", workers)

    def choose_decode(self, hashes, workers):
        return self._next("decode", workers)


class LeastLoadedPolicy:
    name = "least_loaded"

    def choose_prefill(self, hashes, workers):
        return min(workers, key=lambda w: w.in_flight)

    def choose_decode(self, hashes, workers):
        return min(workers, key=lambda w: (w.in_flight + w.running, -w.blocks_free))


def rendezvous_rank(key: BlockHash, name: str) -> bytes:
    """Highest-random-weight hashing: stable across processes (not Python's `hash`)."""
    return hashlib.blake2b(key + name.encode(), digest_size=8).digest()


class PrefixAwarePolicy:
    """Prefill: score = cached prompt blocks - load_weight * queued requests, ties to the prompt's
    home. Decode: the prompt's home while its load stays within `load_slack` of the mean and it has
    free KV; otherwise free KV share and running batch."""

    name = "prefix_aware"

    def __init__(self, load_weight: float = 4.0, affinity_blocks: int = 8, load_slack: float = 1.5,
                 min_free_share: float = 0.1):
        self.load_weight = load_weight
        self.affinity_blocks = affinity_blocks
        self.load_slack = load_slack
        self.min_free_share = min_free_share

    def _rank(self, hashes, w) -> bytes:
        if not hashes:
            return b""
        return rendezvous_rank(hashes[min(len(hashes), self.affinity_blocks) - 1], w.name)

    def choose_prefill(self, hashes, workers):
        return max(workers, key=lambda w: (w.cached_prefix(hashes) - self.load_weight * w.in_flight, -w.in_flight,
                                           self._rank(hashes, w)))

    def choose_decode(self, hashes, workers):
        if hashes:
            load = {w.name: w.in_flight + w.running for w in workers}
            bound = self.load_slack * sum(load.values()) / len(workers) + 1
            for w in sorted(workers, key=lambda w: self._rank(hashes, w), reverse=True):
                if load[w.name] <= bound and w.blocks_free >= self.min_free_share * w.blocks_total:
                    return w
        return max(workers, key=lambda w: (w.blocks_free / max(1, w.blocks_total) - 0.05 * (w.in_flight + w.running),
                                           w.cached_prefix(hashes)))


POLICIES = {"round_robin": RoundRobinPolicy, "least_loaded": LeastLoadedPolicy, "prefix_aware": PrefixAwarePolicy}


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
