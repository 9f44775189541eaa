"""One record per worker, fed by one door (router/worker_pool.py `WorkerPool.observe`) from both
channels: the Ray poll (router/stats_poll.py) and the token stream's pushes (`Router.stats_pushed`).
Fake stats and fake clients: the policy only, no Ray."""
from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest

from cluster.token_stream import TokenReceiver
from cluster.worker_messages import StatsSource, WorkerStats, stats_to_wire
from router.health import Liveness
from router.policy import make_policy
from router.router import Router, RouterConfig
from router.stats_poll import PollRound, StatsCadence, apply_poll, run_stats_poll
from router.worker_pool import WorkerPool

POLL, PUSH = StatsSource.POLL, StatsSource.PUSH


def _stats(name="d0", inc="a", taken_at=1.0, ready=True, **fields) -> WorkerStats:
    return WorkerStats(name=name, role="prefill" if name.startswith("p") else "decode", incarnation=inc, ready=ready,
                       taken_at=taken_at, **fields)


def _wire(stats: WorkerStats) -> dict:
    """A stats frame's body as the receiver hands it on (msgpack lists where the dataclass has tuples)."""
    return msgpack.unpackb(msgpack.packb(stats_to_wire(stats)))


def _pool(clients=None) -> WorkerPool:
    clients = clients or {"p0": None, "d0": None, "d1": None}
    return WorkerPool(RouterConfig(), make_policy("least_loaded"), {n: c for n, c in clients.items() if n[0] == "p"},
                      {n: c for n, c in clients.items() if n[0] != "p"})


def test_a_newer_push_supersedes_an_older_poll_and_not_the_reverse():
    pool = _pool()
    record = pool.records["d0"]
    poll = _stats(taken_at=1.0, blocks_free=10, blocks_total=16)
    push = _stats(taken_at=2.0, blocks_free=4, blocks_total=16, running=3)
    assert pool.observe(poll, POLL, at=100.0)
    assert pool.observe(push, PUSH, at=100.1)                   # read later by the worker: newer
    assert (record.stats, record.source, record.at) == (push, PUSH, 100.1)
    assert (record.view.blocks_free, record.view.running) == (4, 3)
    late_poll = _stats(taken_at=1.5, blocks_free=12, blocks_total=16)   # answered before the push, read after it
    assert not pool.observe(late_poll, POLL, at=100.2)
    assert (record.stats, record.source, record.at) == (push, PUSH, 100.1)
    assert (record.view.blocks_free, record.view.running) == (4, 3)   # the routing view kept the newer figures
    assert record.heard_at == 100.2                             # ... but an older answer still says it lives
    assert pool.latest_stats()["d0"] is push
    newer_poll = _stats(taken_at=3.0, blocks_free=16, blocks_total=16)
    assert pool.observe(newer_poll, POLL, at=100.3)
    assert (record.stats, record.source) == (newer_poll, POLL) and record.view.blocks_free == 16


def test_each_worker_has_its_own_record_and_a_stranger_has_none():
    pool = _pool()
    pool.observe(_stats("d0", blocks_free=1, blocks_total=8), POLL, at=1.0)
    pool.observe(_stats("d1", blocks_free=7, blocks_total=8), PUSH, at=2.0)
    pool.observe(_stats("d1", taken_at=0.5), POLL, at=3.0)                # older: counted, not kept
    assert set(pool.records) == {"p0", "d0", "d1"}
    assert pool.records["p0"].stats is None and pool.records["p0"].heard_at is None
    assert {n: s.blocks_free for n, s in pool.latest_stats().items()} == {"d0": 1, "d1": 7}
    assert (pool.views["d0"].blocks_free, pool.views["d1"].blocks_free) == (1, 7)
    assert pool.records["d0"].pushed_at is None and pool.records["d1"].pushed_at == 2.0
    assert sorted((r.worker, r.source.value, r.count) for r in pool.report_counts()) == [
        ("d0", "poll", 1), ("d1", "poll", 1), ("d1", "push", 1)]
    assert not pool.observe(_stats("d9"), PUSH, at=4.0)                    # not a worker of this pool
    assert "d9" not in pool.records and "d9" not in pool.latest_stats()
    assert all(r.worker != "d9" for r in pool.report_counts())


def test_a_restarted_worker_starts_a_fresh_record_whatever_its_clock():
    async def go():
        pool = _pool()
        record = pool.records["d0"]
        pool.observe(_stats(inc="a", taken_at=50.0, blocks_free=2, blocks_total=8), POLL, at=1.0)
        record.view.remember(["h1", "h2"])                     # the router sent it a prompt
        assert record.view.healthy and pool.healthy("decode") == [record.view]
        from ray.exceptions import ActorDiedError
        pool.worker_failed("d0", ActorDiedError())              # Ray: the actor died
        assert record.health.state is Liveness.DEAD and not record.view.healthy
        assert record.stats.incarnation == "a"                  # its last stats stay until it answers again
        # Ray started it again: a new process, its clock from zero, not yet handshaken.
        assert pool.observe(_stats(inc="b", taken_at=0.1, ready=False, blocks_free=8, blocks_total=8), POLL, at=2.0)
        assert record.stats.incarnation == "b" and record.view.blocks_free == 8
        assert not record.view.cached                           # its prefix cache is empty
        assert record.health.state is Liveness.STARTING and not record.view.healthy
        # The supervisor's bring-up tells it it is ready; its next stats make it routable again.
        assert pool.observe(_stats(inc="b", taken_at=0.2), PUSH, at=2.1)
        assert record.health.state is Liveness.READY and record.view.healthy
    asyncio.run(go())


def test_a_poll_round_and_a_push_both_go_through_observe():
    async def go():
        receiver = TokenReceiver("f")
        pool = _pool()
        router = Router(RouterConfig(), pool, receiver)
        assert receiver.on_stats == router.stats_pushed
        router.stats_pushed("d0", _wire(_stats("d0", taken_at=2.0, running=2)))
        router.stats_pushed("d9", _wire(_stats("d9")))          # not routed here: ignored
        with pytest.raises(ValueError, match="from the connection of"):
            router.stats_pushed("d1", _wire(_stats("d0")))
        apply_poll(pool, PollRound(stats={"d0": _stats("d0", taken_at=1.0), "d1": _stats("d1"),
                                          "p0": _stats("d1")},          # the wrong worker's answer: dropped
                                   failed={}))
        assert (pool.records["d0"].source, pool.records["d0"].stats.running) == (PUSH, 2)
        assert pool.records["d1"].source is POLL and pool.records["p0"].stats is None
        assert pool.records["d0"].reports == {PUSH: 1, POLL: 1}
    asyncio.run(go())


class _Client:
    def __init__(self, stats: WorkerStats | None = None, exc: BaseException | None = None):
        self.answer, self.exc, self.calls = stats, exc, 0

    async def stats(self) -> WorkerStats:
        self.calls += 1
        if self.exc is not None:
            raise self.exc
        return dataclasses.replace(self.answer, taken_at=float(self.calls))


def test_the_one_poll_loop_feeds_the_pool_then_hands_the_round_on():
    """`run_stats_poll`: the due workers polled, answers observed and failures judged before the
    round's hook (the driver's supervisor) sees it; a slow worker is not a dead one."""
    async def go():
        clients = {"p0": _Client(_stats("p0")), "d0": _Client(_stats("d0", running=1)),
                   "d1": _Client(exc=TimeoutError())}
        pool = _pool(clients)
        rounds: list[PollRound] = []

        def on_round(poll: PollRound) -> None:
            assert pool.records["d0"].stats is poll.stats["d0"]   # observed before the hook runs
            rounds.append(poll)
        task = asyncio.ensure_future(run_stats_poll(pool, StatsCadence(busy_s=0.01, idle_s=0.02, linger_s=1.0),
                                                    timeout_s=1.0, on_round=on_round))
        while len(rounds) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        assert set(rounds[0].stats) == {"p0", "d0"} and set(rounds[0].failed) == {"d1"}
        assert pool.records["d0"].view.healthy and pool.records["d0"].reports[POLL] >= 3
        assert pool.records["d1"].health.state is Liveness.STARTING     # never answered; a timeout is no death
        assert pool.records["d0"].stats.taken_at == clients["d0"].calls
    asyncio.run(go())
