"""The router's view of its workers: one `WorkerRecord` per worker (its newest stats, where and when
they came from, its health record (`router/health.py`) and the routing view derived from them
(`router/policy.py` `WorkerView`)), and the wait for a routable worker of a role.

Stats reach a record by one door, `WorkerPool.observe`, from both channels: the Ray poll
(`router/stats_poll.py`) and the worker's pushes over its token stream (`Router.stats_pushed`).
Every reader (routing, prefix fetch, the poll's cadence, the supervisor, the metrics) reads the
records; none keeps a copy. Failed calls feed `worker_failed`: only Ray's word that an actor died
takes a worker out of routing; a slow or failed call of its own does not. A request that finds no
routable worker of its role waits (within `RouterConfig.unavailable_wait_s`) for the cluster to
start or for a restarted worker to come back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.metrics import ReportCount
from cluster.worker_messages import StatsSource, WorkerStats
from router.health import Change, WorkerHealth, is_actor_death
from router.kv_index import ClusterKVIndex
from router.policy import WorkerView
from router.router_config import RouterConfig
from router.workers import WorkerClient, WorkerRoster

log = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The server is stopping: the stream ends with UNAVAILABLE, and the client may retry elsewhere."""


class Drained(RuntimeError):
    """An attempt's decode worker is being drained (cluster/launch/admin.py): the request goes on elsewhere."""


class NoWorker(RuntimeError):
    """No worker of a role became routable within `RouterConfig.unavailable_wait_s`."""


@dataclass
class WorkerRecord:
    """Everything this process knows of one worker, kept once. `view` is what the policy scores:
    its load figures come from `stats`, its routability from `health`; its in-flight count and
    cached blocks are the router's own record of what it sent the worker."""
    view: WorkerView
    health: WorkerHealth
    stats: WorkerStats | None = None     # the newest read (`WorkerStats.supersedes`), polled or pushed
    source: StatsSource | None = None    # the channel `stats` came by
    at: float | None = None              # when `stats` came (time.monotonic())
    heard_at: float | None = None        # when any stats last came, newest or not: it lives
    pushed_at: float | None = None       # when it last pushed here (None: never)
    # StatsSource -> stats received by it; every key from the start: the metrics' scrape thread
    # iterates it while this loop counts.
    reports: dict[StatsSource, int] = field(default_factory=lambda: dict.fromkeys(StatsSource, 0))
    draining: bool = False               # an admin drain (cluster/launch/admin.py): never routed to

    @property
    def name(self) -> str:
        return self.view.name

    def heard(self, source: StatsSource, at: float) -> None:
        self.reports[source] += 1
        self.heard_at = at if self.heard_at is None else max(self.heard_at, at)
        if source is StatsSource.PUSH:
            self.pushed_at = at if self.pushed_at is None else max(self.pushed_at, at)


class WorkerPool:
    def __init__(self, config: RouterConfig, policy, prefill: Mapping[str, WorkerClient],
                 decode: Mapping[str, WorkerClient]):
        """`prefill`/`decode`: worker name -> client (see cluster/launch/app.py)."""
        self.config = config
        self.policy = policy
        self.clients = {**prefill, **decode}
        self.kv_index = ClusterKVIndex(config.kv_index_stale_s)   # fed by router.kv_index.feed_kv_events
        roles = [*((n, "prefill") for n in prefill), *((n, "decode") for n in decode)]
        self.records = {n: self._record(n, role) for n, role in roles}
        self._routable_changed = asyncio.Event()
        self.closed = False
        self.on_leaving = None      # (name) -> None: stats that first say `leaving` (SIGTERM; the driver's admin)

    def _record(self, name: str, role: str) -> WorkerRecord:
        return WorkerRecord(WorkerView(name, role, healthy=False, index=self.kv_index),
                            WorkerHealth(name, stall_s=self.config.stall_timeout_s))

    @classmethod
    def of_roster(cls, config: RouterConfig, policy, clients: Mapping[str, WorkerClient],
                  roster: WorkerRoster) -> WorkerPool:
        """The pool of the roster's workers, each with its client from `clients`."""
        return cls(config, policy, {n: clients[n] for n in roster.prefill}, {n: clients[n] for n in roster.decode})

    # --- what the records say, as their readers ask -------------------------------------------
    @property
    def views(self) -> dict[str, WorkerView]:
        return {n: r.view for n, r in self.records.items()}

    @property
    def health(self) -> dict[str, WorkerHealth]:
        return {n: r.health for n, r in self.records.items()}

    def latest_stats(self) -> dict[str, WorkerStats]:
        """Worker -> its newest stats, for the workers heard from (the metrics read these)."""
        return {n: r.stats for n, r in self.records.items() if r.stats is not None}

    def report_counts(self) -> list[ReportCount]:
        """The stats each worker sent, by channel (`splitserve_worker_stats_reports_total`)."""
        return [ReportCount(n, source, count) for n, r in self.records.items()
                for source, count in r.reports.items() if count]

    def healthy(self, role: str) -> list[WorkerView]:
        return [r.view for r in self.records.values() if r.view.role == role and r.view.healthy]

    @property
    def ready(self) -> bool:
        """Every worker has loaded and been handshaken at least once (gRPC health: SERVING)."""
        return all(r.view.healthy for r in self.records.values())

    def largest_decode_pool(self) -> int | None:
        """The most KV blocks a decode worker that has answered a poll holds (None: none has yet)."""
        sizes = [r.view.blocks_total for r in self.records.values()
                 if r.view.role == "decode" and r.health.incarnation is not None]
        return max(sizes) if sizes else None

    # --- what feeds them ------------------------------------------------------------------------
    def observe(self, stats: WorkerStats, source: StatsSource, at: float) -> bool:
        """A worker's stats, polled or pushed, received at `at` (time.monotonic()). Stats older than
        the ones already read (a poll answered before a push, read after it) only say it lives;
        newer ones set its load figures and health. False when they are not kept (older, or of a
        worker this pool does not route)."""
        record = self.records.get(stats.name)
        if record is None:
            return False
        record.heard(source, at)
        if not stats.supersedes(record.stats):
            return False
        was_leaving = record.stats is not None and record.stats.leaving
        record.stats, record.source, record.at = stats, source, at
        self._judge(record, stats)
        if stats.leaving and not was_leaving and self.on_leaving is not None:
            self.on_leaving(stats.name)
        return True

    def _judge(self, record: WorkerRecord, stats: WorkerStats) -> None:
        """The newest stats' load figures into the routing view, and their word on its health."""
        first_start = record.health.incarnation is None
        change = record.health.observe(stats)
        view = record.view
        if change is Change.NEW_INCARNATION:
            view.cached.clear()            # a restarted worker's prefix cache is empty
        if change is not Change.NONE:
            # A worker's first incarnation is the cluster starting, not news an operator must act on.
            (log.info if first_start else log.warning)("worker %s: %s (now %s)", view.name, change.value,
                                                       record.health.state.value)
        view.blocks_free, view.blocks_total, view.running = stats.blocks_free, stats.blocks_total, stats.running
        self._set_routable(record)

    def worker_failed(self, name: str, exc: BaseException) -> None:
        """A call to the worker raised. Only Ray's word that the actor died takes it out of routing;
        a timeout or an error of the call's own is not a dead worker."""
        record = self.records[name]
        if is_actor_death(exc) and record.health.died() is Change.DIED:
            log.warning("worker %s died (%s); routing around it until it is back", name, type(exc).__name__)
            self.kv_index.forget(name)
            self._set_routable(record)

    # --- waiting for a routable worker ---------------------------------------------------------
    async def routing_changed(self) -> None:
        """Returns at the next change of any worker's routability."""
        await self._routable_changed.wait()

    # --- the admin operations' changes (cluster/launch/admin.py) ----------------------------------
    def add(self, name: str, role: str, client: WorkerClient) -> None:
        """A worker added to a running cluster: routed to once its stats say it is ready."""
        self.clients[name] = client
        self.records[name] = self._record(name, role)

    def remove(self, name: str) -> None:
        """A drained worker leaves: no record, no client, nothing of it in the KV index."""
        self.records.pop(name, None)
        self.clients.pop(name, None)
        self.kv_index.forget(name)
        self._wake()

    def set_draining(self, name: str, draining: bool) -> None:
        record = self.records[name]
        record.draining = draining
        self._set_routable(record)

    def set_role(self, name: str, role: str) -> None:
        """A worker's new role (a role switch; it keeps its name); its prefix cache stays valid."""
        self.records[name].view.role = role
        self._wake()

    def _set_routable(self, record: WorkerRecord) -> None:
        routable = record.health.routable and not record.draining
        if routable != record.view.healthy:
            record.view.healthy = routable
            self._wake()

    def _wake(self) -> None:
        self._routable_changed.set()
        self._routable_changed = asyncio.Event()

    async def routable(self, role: str) -> list[WorkerView]:
        """The routable workers of `role`, waiting (within the request's deadline, which the server
        enforces around us) while there are none: the cluster is starting, or they are restarting."""
        limit = time.monotonic() + self.config.unavailable_wait_s
        while not (views := self.healthy(role)):
            if self.closed:
                raise ShuttingDown("the server is shutting down")
            left = limit - time.monotonic()
            if left <= 0:
                raise NoWorker(f"no {role} worker became available within {self.config.unavailable_wait_s:.0f}s")
            try:
                await asyncio.wait_for(self._routable_changed.wait(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        return views

    def close(self) -> None:
        """The server stops: every wait for a routable worker ends with `ShuttingDown`."""
        self.closed = True
        self._routable_changed.set()
