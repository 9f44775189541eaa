"""The stats poll: the one loop of a process that asks its workers for their stats over Ray
(`run_stats_poll`), and its cadence (`StatsCadence`: which workers are due, and when).

Each process that holds a `WorkerPool` runs one: the driver (`cluster/launch/app.py`: the
supervisor's restarts and the metrics, and the routing view of the in-process frontend), and each
actor frontend of `--frontends N` (its own routing view, `router/frontend.py`). Every answer goes
to `WorkerPool.observe` as the pushes do; a failed call to `WorkerPool.worker_failed`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from cluster.worker_messages import MessageRefused, StatsSource, WorkerStats
from router.worker_pool import WorkerPool, WorkerRecord
from router.workers import WorkerClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PollRound:
    """One stats poll of every worker due: those that answered (`stats`) and those whose call raised
    (`failed`: a timeout is `TimeoutError`, slow, not dead; stats of another version are
    `MessageRefused`, logged, never read)."""
    stats: Mapping[str, WorkerStats]
    failed: Mapping[str, BaseException]


async def poll_workers(clients: Mapping[str, WorkerClient], timeout_s: float) -> PollRound:
    """Every worker's stats at once (one slow worker delays no other)."""
    async def one(name, client):
        try:
            return await asyncio.wait_for(client.stats(), timeout=timeout_s)
        except MessageRefused as exc:
            log.warning("worker %s: stats refused (%s)", name, exc)
            return exc
        except Exception as exc:  # noqa: BLE001 - judged by the pool (WorkerPool.worker_failed)
            return exc
    results = dict(zip(clients, await asyncio.gather(*(one(n, c) for n, c in clients.items()))))
    return PollRound(stats={n: r for n, r in results.items() if not isinstance(r, BaseException)},
                     failed={n: r for n, r in results.items() if isinstance(r, BaseException)})


def apply_poll(pool: WorkerPool, poll: PollRound) -> None:
    """One poll round into the pool: each answer observed, each failure judged."""
    now = time.monotonic()
    for name, exc in poll.failed.items():
        pool.worker_failed(name, exc)
    for name, stats in poll.stats.items():
        if stats.name != name:
            log.warning("worker %s answered with the stats of %r: dropped", name, stats.name)
            continue
        pool.observe(stats, StatsSource.POLL, now)


class Demand(Protocol):
    """What the poll reads of the router it feeds (router/router.py `Router`): the requests it has in
    flight, and the event each new one sets."""
    in_flight: int
    activity: asyncio.Event


async def run_stats_poll(pool: WorkerPool, cadence: StatsCadence, timeout_s: float, demand: Demand | None = None,
                         on_round: Callable[[PollRound], None] | None = None) -> None:
    """Poll the workers that are due, feed the answers to `pool`, hand the round to `on_round` (the
    driver's supervisor), sleep until the next round or `demand`'s next request; forever. A slow
    poll is skipped (`timeout_s`), never a verdict."""
    while True:
        poll = await poll_workers({n: pool.clients[n] for n in cadence.due(pool)}, timeout_s)
        apply_poll(pool, poll)
        if on_round is not None:
            on_round(poll)
        await cadence.sleep(pool, demand)


class StatsCadence:
    """Which workers to poll over Ray, and when. A worker is polled while the cluster has work (or
    had it in the last `linger_s`) every `busy_s`, when idle every `idle_s`: routing needs fresh
    load figures under load, and an idle cluster should not wake every worker (and Ray's io
    threads) several times a second for nothing. A stepping worker pushes its stats over its token
    stream (`WorkerRecord.pushed_at`); one whose pushes are fresh is not polled (a push says it
    lives, and each Ray call costs the driver ~2 ms of CPU), and one that has pushed here and holds
    work of this router is polled every `idle_s`, its pushes late only because a step runs. A
    worker whose latest stats showed it idle and that this router has given nothing since (a
    prefill worker between prompts) is polled every `idle_s` too: what it will do next starts
    here, and once it steps it pushes. (With several frontends another one may load it first: its
    view then lags by at most `idle_s`.) It reads the pool's records; its own state is only when it
    last sent each worker a poll."""

    def __init__(self, busy_s: float = 0.25, idle_s: float = 2.0, linger_s: float = 5.0):
        self.busy_s, self.idle_s, self.linger_s = busy_s, idle_s, linger_s
        self.last_busy = time.monotonic()
        self.polled_at: dict[str, float] = {}      # worker -> when its last Ray poll was sent
        self.period = busy_s

    def due(self, pool: WorkerPool) -> list[str]:
        """The workers to poll now: those never polled, not heard from (polled or pushed) for
        `idle_s`, or whose latest stats are older than the period plus one push interval."""
        now = time.monotonic()
        out = [name for name, record in pool.records.items() if self._is_due(record, now)]
        for name in out:
            self.polled_at[name] = now
        return out

    def _is_due(self, record: WorkerRecord, now: float) -> bool:
        polled = self.polled_at.get(record.name)
        if polled is None:
            return True
        pushed = record.pushed_at
        seen = polled if pushed is None else max(polled, pushed)
        if now - seen >= self.idle_s - 0.01:     # nothing heard for idle_s: does it live?
            return True
        period = self.idle_s if self._resting(record) or self._pushes_here(record) else self.period
        return now - seen >= period + (self.busy_s if pushed is not None else 0.0) - 0.01

    @staticmethod
    def _pushes_here(record: WorkerRecord) -> bool:
        """This router has work on the worker and has heard its pushes: it pushes after each step, so
        stats older than a push interval mean a step still runs (a prefill of thousands of tokens
        takes seconds on a CPU), and a poll would only read the same queue this router filled."""
        return record.view.in_flight > 0 and record.pushed_at is not None

    @staticmethod
    def _resting(record: WorkerRecord) -> bool:
        """Idle at its latest stats, and nothing sent to it by this router since."""
        return record.stats is not None and not record.stats.busy and not record.view.in_flight

    async def sleep(self, pool: WorkerPool, demand: Demand | None = None) -> None:
        """Sleep until the next poll is due, or until `demand` takes a new request."""
        period = self.next(pool.latest_stats().values(), demand.in_flight if demand is not None else 0)
        if demand is None:
            await asyncio.sleep(period)
            return
        demand.activity.clear()
        try:
            await asyncio.wait_for(demand.activity.wait(), timeout=period)
        except asyncio.TimeoutError:
            pass

    def next(self, stats: Iterable[WorkerStats], in_flight: int = 0) -> float:
        """The period until the next round, from every worker's latest stats."""
        now = time.monotonic()
        if in_flight or any(s.busy for s in stats):
            self.last_busy = now
        self.period = self.busy_s if now - self.last_busy < self.linger_s else self.idle_s
        return self.period
