"""The router's side of the worker actors: one typed client per worker, and the stats poll.

Every call is a typed method taking and returning the frozen messages of
`cluster/worker_messages.py`: no method names as strings, no positional argument lists. Data calls
(`prefill`, `generate`, `decode`) run in the actor's default concurrency group; control calls
(`abort`, `stats`, the handshake) in its "control" group, so that they never queue behind the
streams. What comes back is checked for its type and version (`expect`) before it is read.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cluster.kv.kv_events import KVEventBatch
from cluster.worker_messages import CONTROL, DecodeCall, GenerateCall, MessageRefused, PrefillCall, PrefillResult, \
    WorkerStats, expect

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class WorkerRoster:
    """Which worker plays which role, by name: what the wiring started, as the frontends are told."""
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    def role_of(self, name: str) -> str:
        if name in self.prefill:
            return "prefill"
        if name in self.decode:
            return "decode"
        raise KeyError(f"no worker {name!r} in the roster")

    @property
    def disaggregated(self) -> bool:
        """Both roles have workers: each prefill worker is handshaken with each decode worker."""
        return bool(self.prefill and self.decode)


class WorkerClient:
    """One worker actor (a prefill or decode worker) as the router and the driver call it."""

    def __init__(self, name: str, handle):
        self.name = name
        self.handle = handle

    def _control(self, method):
        return method.options(concurrency_group=CONTROL)

    # --- data calls ------------------------------------------------------------------------------
    async def prefill(self, call: PrefillCall) -> PrefillResult:
        return expect(await self.handle.prefill.remote(call), PrefillResult)

    def generate(self, call: GenerateCall):
        """Start a streamed request; its deltas come over the token stream. The returned ref
        resolves when it ends (with its `FinishReason`), or raises if the worker dies."""
        return self.handle.generate.remote(call)

    def decode(self, call: DecodeCall):
        """Start the decode of a handed-off request (as `generate`)."""
        return self.handle.decode.remote(call)

    # --- control calls ---------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        await self._control(self.handle.abort).remote(request_id)

    async def stats(self) -> WorkerStats:
        return expect(await self._control(self.handle.stats).remote(), WorkerStats)

    async def kv_events(self, epoch: str, cursor: int) -> KVEventBatch:
        return expect(await self._control(self.handle.kv_events).remote(epoch, cursor), KVEventBatch)

    async def metadata(self) -> bytes:
        return await self._control(self.handle.metadata).remote()

    async def add_peer(self, metadata: bytes) -> str:
        return await self._control(self.handle.add_peer).remote(metadata)

    async def set_ready(self, incarnation: str) -> bool:
        return await self._control(self.handle.set_ready).remote(incarnation)


@dataclass(frozen=True)
class PollRound:
    """One stats poll of every worker: those that answered (`stats`) and those whose call raised
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
        except Exception as exc:  # noqa: BLE001 - judged by the caller (router.worker_failed)
            return exc
    results = dict(zip(clients, await asyncio.gather(*(one(n, c) for n, c in clients.items()))))
    return PollRound(stats={n: r for n, r in results.items() if not isinstance(r, BaseException)},
                     failed={n: r for n, r in results.items() if isinstance(r, BaseException)})


def apply_poll(router, poll: PollRound) -> list[WorkerStats]:
    """Feed one poll round to a router's health and routing views; returns the stats that came."""
    for name, exc in poll.failed.items():
        router.worker_failed(name, exc)
    for name, stats in poll.stats.items():
        router.worker_polled(name, stats)
    return list(poll.stats.values())


class StatsCadence:
    """Which workers to poll over Ray, and when. A worker is polled while the cluster has work (or
    had it in the last `linger_s`) every `busy_s`, when idle every `idle_s`: routing needs fresh
    load figures under load, and an idle cluster should not wake every worker (and Ray's io
    threads) several times a second for nothing. A stepping worker pushes its stats over its token
    stream (`router.pushed`); one whose pushes are fresh is not polled (a push says it lives, and
    each Ray call costs the driver ~2 ms of CPU), and one that has pushed here and holds work of
    this router is polled every `idle_s`, its pushes late only because a step runs. A worker whose
    latest stats showed it idle and that this router has given nothing since (a prefill worker
    between prompts) is polled every `idle_s` too: what it will do next starts here, and once it
    steps it pushes. (With several frontends another one may load it first: its view then lags by
    at most `idle_s`.)"""

    def __init__(self, busy_s: float = 0.25, idle_s: float = 2.0, linger_s: float = 5.0):
        self.busy_s, self.idle_s, self.linger_s = busy_s, idle_s, linger_s
        self.last_busy = time.monotonic()
        self.polled_at: dict[str, float] = {}      # worker -> when its last Ray poll was sent
        self.latest: dict[str, tuple[float, WorkerStats]] = {}   # worker -> (when, its latest stats), polled or pushed
        self.period = busy_s

    def due(self, names, router=None) -> list[str]:
        """The workers to poll now: those never polled, not heard from (polled or pushed) for
        `idle_s`, or whose latest stats are older than the period plus one push interval."""
        now = time.monotonic()
        pushed = router.pushed if router is not None else {}
        out = []
        for name in names:
            polled = self.polled_at.get(name)
            if polled is None:
                out.append(name)
                continue
            seen = max(polled, pushed[name][0]) if name in pushed else polled
            if now - seen >= self.idle_s - 0.01:     # nothing heard for idle_s: does it live?
                out.append(name)
                continue
            period = self.idle_s if self._resting(name, router) or self._pushes_here(name, router) else self.period
            if now - seen >= period + (self.busy_s if name in pushed else 0.0) - 0.01:
                out.append(name)
        for name in out:
            self.polled_at[name] = now
        return out

    @staticmethod
    def _pushes_here(name: str, router) -> bool:
        """This router has work on the worker and has heard its pushes: it pushes after each step, so
        stats older than a push interval mean a step still runs (a prefill of thousands of tokens
        takes seconds on a CPU), and a poll would only read the same queue this router filled."""
        view = router.views.get(name) if router is not None else None
        return view is not None and view.in_flight > 0 and name in router.pushed

    def _resting(self, name: str, router) -> bool:
        """Idle at its latest stats, and nothing sent to it by this router since."""
        _, stats = self.latest.get(name, (0.0, None))
        view = router.views.get(name) if router is not None else None
        return stats is not None and not stats.busy and (view is None or not view.in_flight)

    def observe(self, stats: list[WorkerStats], router=None) -> float:
        """Take this round's polled stats and the pushed ones; the period until the next round."""
        now = time.monotonic()
        pushed = [(at, s) for at, s in router.pushed.values()] if router is not None else []
        for at, s in [*((now, s) for s in stats), *pushed]:
            if s.supersedes(self.latest.get(s.name, (0.0, None))[1]):
                self.latest[s.name] = (at, s)
        return self.next([s for _, s in self.latest.values()], router.in_flight if router is not None else 0)

    async def sleep(self, stats: list[WorkerStats], router=None) -> None:
        """Sleep until the next poll is due, or until `router` takes a new request."""
        period = self.observe(stats, router)
        if router is None:
            await asyncio.sleep(period)
            return
        router.activity.clear()
        try:
            await asyncio.wait_for(router.activity.wait(), timeout=period)
        except asyncio.TimeoutError:
            pass

    def next(self, stats: list[WorkerStats], in_flight: int = 0) -> float:
        """The period until the next round, from every worker's latest stats."""
        now = time.monotonic()
        if in_flight or any(s.busy for s in stats):
            self.last_busy = now
        self.period = self.busy_s if now - self.last_busy < self.linger_s else self.idle_s
        return self.period
