"""The cluster-wide KV index: which block keys each worker holds, in its pool and in each tier.

Fed by the workers' KV event logs (`cluster/kv/kv_events.py`), read with a cursor per worker by
`feed_kv_events` at the stats cadence: events when the reader kept up, a snapshot when it did not
or the worker restarted (another epoch). Routing asks `cached` for the longest prefix of a
prompt's block keys that a worker holds in its pool, and how much further its host and disk tiers
take it. A node-shared host tier is one set per `host_domain`, read by every worker of it.

Staleness: a worker whose log has not been read for `stale_after_s` (the calls time out, the
worker hangs) is marked stale: its claims are not used (routing treats it as holding nothing,
routing on load), `splitserve_router_kv_index_stale{worker}` says so, and a warning is logged
once per episode. A worker the router has not read yet (the cluster starting, a restarted worker)
has no claims: routing counts what the router itself sent it (`policy.WorkerView.cached_prefix`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cluster.kv.hashing import BlockHash
from cluster.kv.kv_events import KVEventBatch, KVEventKind, KVTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedLength:
    """Leading blocks of a prompt a worker holds: in its pool, with its host tier, with its disk."""
    pool: int = 0
    host: int = 0       # pool + host tier (blocks a load from host memory brings back)
    disk: int = 0       # pool + host + disk


@dataclass
class _WorkerKeys:
    epoch: str = ""
    cursor: int = 0
    domain: str = ""
    pool: set = field(default_factory=set)
    disk: set = field(default_factory=set)
    heard_at: float | None = None
    stale: bool = False


class ClusterKVIndex:
    def __init__(self, stale_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.workers: dict[str, _WorkerKeys] = {}
        self.host: dict[str, set] = {}                 # host domain -> keys
        self.counts = {"events": 0, "snapshot": 0}

    def cursor(self, worker: str) -> tuple[str, int]:
        w = self.workers.get(worker)
        return (w.epoch, w.cursor) if w is not None else ("", 0)

    def apply(self, batch: KVEventBatch, asked_at: float | None = None) -> None:
        """Apply one read of a worker's log, asked for at `asked_at` (its state is at least that new)."""
        w = self.workers.setdefault(batch.worker, _WorkerKeys())
        w.domain = batch.host_domain
        host = self.host.setdefault(batch.host_domain, set())
        if batch.snapshot is not None:
            self.counts["snapshot"] += 1
            held = dict(batch.snapshot)
            w.pool, w.disk = set(held.get(KVTier.POOL, ())), set(held.get(KVTier.DISK, ()))
            host.clear()
            host.update(held.get(KVTier.HOST, ()))
        for event in batch.events:
            self.counts["events"] += 1
            keys = {KVTier.POOL: w.pool, KVTier.HOST: host, KVTier.DISK: w.disk}[event.tier]
            if event.kind is KVEventKind.STORED:
                keys.update(event.keys)
            else:
                keys.difference_update(event.keys)
        w.epoch, w.cursor, w.heard_at = batch.epoch, batch.cursor, self.clock() if asked_at is None else asked_at
        if w.stale:
            log.warning("KV events from worker %s arrive again: routing on its cached blocks", batch.worker)
            w.stale = False

    def is_stale(self, worker: str) -> bool:
        """No events read from `worker` for `stale_after_s` (or never): its claims are not used."""
        w = self.workers.get(worker)
        if w is None or w.heard_at is None:
            return True
        if self.clock() - w.heard_at > self.stale_after_s:
            if not w.stale:
                log.warning("no KV events from worker %s for %.1f s: routing on load, not on its cached "
                            "blocks, until they arrive", worker, self.clock() - w.heard_at)
                w.stale = True
            return True
        return False

    def has_heard(self, worker: str) -> bool:
        """Whether `worker`'s events have been read since it started (or since `forget`)."""
        w = self.workers.get(worker)
        return w is not None and w.heard_at is not None

    def heard_at(self, worker: str) -> float | None:
        """When `worker`'s events were last read (None: stale or never)."""
        return None if self.is_stale(worker) else self.workers[worker].heard_at

    def forget(self, worker: str) -> None:
        """A dead worker's claims go with it (its restart sends a snapshot)."""
        w = self.workers.get(worker)
        if w is not None:
            w.pool, w.disk, w.heard_at, w.epoch = set(), set(), None, ""

    def cached(self, worker: str, hashes: list[BlockHash]) -> CachedLength:
        if not hashes or self.is_stale(worker):
            return CachedLength()
        w = self.workers[worker]
        host = self.host.get(w.domain, set())
        pool = _leading(hashes, lambda h: h in w.pool)
        with_host = pool + _leading(hashes[pool:], lambda h: h in w.pool or h in host)
        return CachedLength(pool, with_host,
                            with_host + _leading(hashes[with_host:], lambda h: h in w.pool or h in host or h in w.disk))

    def samples(self) -> dict[str, tuple[bool, int, int, int]]:
        """Per worker: stale, and the blocks the index holds for it in pool, host (its domain), disk."""
        return {n: (self.is_stale(n), len(w.pool), len(self.host.get(w.domain, ())), len(w.disk))
                for n, w in self.workers.items()}


def _leading(hashes: list[BlockHash], held: Callable[[BlockHash], bool]) -> int:
    n = 0
    for h in hashes:
        if not held(h):
            break
        n += 1
    return n


async def feed_kv_events(index: ClusterKVIndex, clients: Mapping, period_s: float, timeout_s: float,
                         on_round: Callable[[ClusterKVIndex], None] | None = None) -> None:
    """Read every worker's KV events each `period_s`; `on_round` (the metrics) sees the index after
    each round. Each worker's read runs on its own: a worker whose last read is still out (slow, or
    hung until `timeout_s`) is skipped that round, so it delays no other worker's updates (a
    round that waited for it would leave the others unread past the stale window: all stale)."""
    reading: dict[str, asyncio.Future] = {}
    try:
        while True:
            for name, client in list(clients.items()):   # read afresh: a restarted worker's client
                if name not in reading or reading[name].done():
                    reading[name] = asyncio.ensure_future(_read_kv_events(index, name, client, timeout_s))
            for name in clients:
                index.is_stale(name)           # logs the moment a worker goes stale
            if on_round is not None:
                on_round(index)
            await asyncio.sleep(period_s)
    finally:
        for task in reading.values():
            task.cancel()


async def _read_kv_events(index: ClusterKVIndex, name: str, client, timeout_s: float) -> None:
    try:
        epoch, cursor = index.cursor(name)
        asked_at = index.clock()
        index.apply(await asyncio.wait_for(client.kv_events(epoch, cursor), timeout_s), asked_at)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a worker that does not answer goes stale, see is_stale
        log.debug("reading KV events of %s failed: %r", name, exc)
