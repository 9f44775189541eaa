"""The KV event log of a worker and the router's cluster-wide index built from it: batched events
read with a cursor, snapshots after a gap or a restart, cached lengths per tier, a node-shared host
tier, staleness (claims of a worker whose events stopped are never routed on), and routing on
what the router sent a worker it has not read yet."""
from __future__ import annotations

import asyncio
import logging

import torch

from cluster.kv.block_pool import BlockPool
from cluster.kv.kv_events import KVEventKind, KVEventLog, KVTier
from cluster.kv.tier_store import DiskTier, HostTier
from router.kv_index import CachedLength, ClusterKVIndex, feed_kv_events
from router.policy import PrefixAwarePolicy, WorkerView


K = [bytes([i]) * 16 for i in range(12)]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_log_batches_changes_and_reads_from_a_cursor():
    log = KVEventLog("w0")
    for k in K[:3]:
        log.stored(KVTier.POOL, k)
    log.removed(KVTier.POOL, K[0])
    log.removed(KVTier.POOL, K[0])              # no change: not logged
    first = log.read("", 0)
    assert first.snapshot is not None           # a reader of another epoch starts from a snapshot
    assert set(dict(first.snapshot)[KVTier.POOL]) == {K[1], K[2]}
    log.stored(KVTier.HOST, K[4])
    log.stored(KVTier.HOST, K[5])
    log.stored(KVTier.DISK, K[4])
    batch = log.read(first.epoch, first.cursor)
    assert batch.snapshot is None
    assert [(e.kind, e.tier, e.keys) for e in batch.events] == [
        (KVEventKind.STORED, KVTier.HOST, (K[4], K[5])), (KVEventKind.STORED, KVTier.DISK, (K[4],))]
    assert log.read(batch.epoch, batch.cursor).events == ()


def test_a_reader_that_fell_off_the_log_gets_a_consistent_snapshot():
    log = KVEventLog("w0", capacity=2)
    start = log.read("", 0)
    for i, k in enumerate(K[:6]):             # alternating kinds: one event each, the log keeps 2
        log.stored(KVTier.POOL, k)
        if i % 2:
            log.removed(KVTier.POOL, k)
    late = log.read(start.epoch, start.cursor)
    assert late.snapshot is not None and set(dict(late.snapshot)[KVTier.POOL]) == {K[0], K[2], K[4]}
    index = ClusterKVIndex()
    index.apply(start)
    index.apply(late)
    assert index.workers["w0"].pool == {K[0], K[2], K[4]}


def test_index_lengths_per_tier_and_a_shared_host_domain():
    clock = Clock()
    index = ClusterKVIndex(stale_after_s=5.0, clock=clock)
    a, b = KVEventLog("a", host_domain="node1/seg"), KVEventLog("b", host_domain="node1/seg")
    segment: set = set()                        # the shared tier's own index, which both change
    a.snapshot_sources[KVTier.HOST] = b.snapshot_sources[KVTier.HOST] = lambda: tuple(segment)
    for k in K[:2]:
        a.stored(KVTier.POOL, k)
    index.apply(a.read("", 0))
    index.apply(b.read("", 0))
    for k in K[2:4]:                            # a stores into the shared segment: b reads it too
        segment.add(k)
        a.stored(KVTier.HOST, k)
    a.stored(KVTier.DISK, K[4])
    index.apply(a.read(*index.cursor("a")))
    hashes = K[:6]
    assert index.cached("a", hashes) == CachedLength(pool=2, host=4, disk=5)
    assert index.cached("b", hashes) == CachedLength(pool=0, host=0, disk=0)   # the chain starts in a's pool
    assert index.cached("b", K[2:6]) == CachedLength(pool=0, host=2, disk=2)
    segment.discard(K[3])
    b.removed(KVTier.HOST, K[3])                # b evicted a block a stored: the domain loses it
    index.apply(b.read(*index.cursor("b")))
    assert index.cached("a", hashes) == CachedLength(pool=2, host=3, disk=3)


def test_a_worker_whose_events_stop_is_routed_on_load_alone(caplog):
    clock = Clock()
    index = ClusterKVIndex(stale_after_s=5.0, clock=clock)
    logs = {n: KVEventLog(n) for n in ("p0", "p1")}
    for k in K[:8]:
        logs["p1"].stored(KVTier.POOL, k)
    for log in logs.values():
        index.apply(log.read("", 0))
    views = [WorkerView(n, "prefill", index=index) for n in logs]
    policy = PrefixAwarePolicy()
    assert policy.choose_prefill(K[:8], views).name == "p1"
    assert views[1].cached_prefix(K[:8]) == 8
    clock.now += 6.0                            # p1's events stop; p0's keep coming
    index.apply(logs["p0"].read(*index.cursor("p0")))
    with caplog.at_level(logging.WARNING, logger="router.kv_index"):
        assert views[1].cached_prefix(K[:8]) == 0
        assert index.is_stale("p1") and not index.is_stale("p0")
    assert sum("no KV events from worker p1" in r.getMessage() for r in caplog.records) == 1
    views[1].in_flight = 0
    views[0].in_flight = 1                      # load decides now: the idle worker
    assert policy.choose_prefill(K[:8], views).name == "p1"
    views[0].in_flight, views[1].in_flight = 0, 1
    assert policy.choose_prefill(K[:8], views).name == "p0"
    index.apply(logs["p1"].read(*index.cursor("p1")))
    assert views[1].cached_prefix(K[:8]) == 8 and not index.is_stale("p1")
    index.forget("p1")                          # died: nothing claimed until its restart reports
    assert views[1].cached_prefix(K[:8]) == 0


def test_a_worker_not_read_yet_is_routed_on_what_the_router_sent_it():
    index = ClusterKVIndex(stale_after_s=5.0)
    view = WorkerView("d0", "decode", index=index)
    view.remember(K[:6])
    assert view.cached_prefix(K[:8]) == 6       # the cluster starting: no events read yet (the race
    log = KVEventLog("d0")                      # that sent a prompt its decode worker held elsewhere)
    for k in K[:3]:
        log.stored(KVTier.POOL, k)
    index.apply(log.read("", 0))
    assert view.cached_prefix(K[:8]) == 3       # read after the router sent them: the worker's word
    view.remember(K[:8])
    assert view.cached_prefix(K[:8]) == 8       # sent after that read: not in its events yet


class _LogClient:
    """A worker's KV event reads as the router sees them (a coroutine per read), or one that hangs."""
    def __init__(self, log: KVEventLog | None):
        self.log, self.reads = log, 0

    async def kv_events(self, epoch: str, cursor: int):
        self.reads += 1
        if self.log is None:
            await asyncio.Event().wait()    # hung: never answers
        return self.log.read(epoch, cursor)


def test_a_hung_worker_delays_no_other_workers_kv_events():
    index = ClusterKVIndex(stale_after_s=5.0)
    log = KVEventLog("p0")
    clients = {"hung": _LogClient(None), "p0": _LogClient(log)}
    rounds = []

    async def until(done):                  # conditions, not fixed sleeps: a loaded machine is slow
        while not done():
            await asyncio.sleep(0.01)

    async def run():
        feed = asyncio.ensure_future(feed_kv_events(index, clients, 0.01, 30.0, rounds.append))
        await asyncio.wait_for(until(lambda: clients["p0"].reads >= 5), 10.0)   # the old gather: 1 read in 30 s
        log.stored(KVTier.POOL, K[0])       # arrives while the other worker's read is still out
        await asyncio.wait_for(until(lambda: index.cached("p0", K[:1]).pool == 1), 10.0)
        feed.cancel()
        await asyncio.gather(feed, return_exceptions=True)

    asyncio.run(run())
    assert clients["hung"].reads == 1       # one read out at a time per worker
    assert len(rounds) >= 5 and not index.is_stale("p0")
    assert index.is_stale("hung")


def test_pool_and_tiers_report_what_they_gain_and_lose(tmp_path):
    log = KVEventLog("w0")
    pool = BlockPool(4)
    pool.events = log
    blocks = pool.allocate(2)
    for b, k in zip(blocks, K[:2]):
        pool.cache_block(b, k)
    pool.free(reversed(blocks))
    pool.allocate(4)                            # reuses both cached blocks: evicted
    host = HostTier(2, (2, 2), torch.float32, pin=False)
    host.events = log
    for k in K[4:7]:                            # the third evicts the first
        host.commit(k, host.take_slot(), 0)
    disk = DiskTier(tmp_path, "layout", limit=64)
    disk.events = log
    payload = memoryview(bytes(16))
    for k in K[8:11]:
        disk.write(k, payload, 0)
    disk.drop(K[9])
    snap = dict(log.read("", 0).snapshot)
    assert set(snap[KVTier.POOL]) == set()
    assert set(snap[KVTier.HOST]) == {K[5], K[6]} == set(host.index)
    assert set(snap[KVTier.DISK]) == {K[8], K[10]} == set(disk.index)
