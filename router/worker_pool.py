"""The router's view of its workers: one typed client, one routing view (`router/policy.py`
`WorkerView`) and one health record (`router/health.py`) per worker, and the wait for a routable
worker of a role.

Fed by the stats poll (`worker_polled`) and by failed calls (`worker_failed`): only Ray's word that
an actor died takes a worker out of routing; a slow or failed call of its own does not. A request
that finds no routable worker of its role waits (within `RouterConfig.unavailable_wait_s`) for the
cluster to start or for a restarted worker to come back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from cluster.worker_messages import WorkerStats
from router.health import Change, WorkerHealth, is_actor_death
from router.kv_index import ClusterKVIndex
from router.policy import WorkerView
from router.router_config import RouterConfig
from router.workers import WorkerClient

log = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The server is stopping: the stream ends with UNAVAILABLE, and the client may retry elsewhere."""


class NoWorker(RuntimeError):
    """No worker of a role became routable within `RouterConfig.unavailable_wait_s`."""


class WorkerPool:
    def __init__(self, config: RouterConfig, policy, prefill: Mapping[str, WorkerClient],
                 decode: Mapping[str, WorkerClient]):
        """`prefill`/`decode`: worker name -> client (see cluster/launch/app.py)."""
        self.config = config
        self.policy = policy
        self.clients = {**prefill, **decode}
        self.kv_index = ClusterKVIndex(config.kv_index_stale_s)   # fed by router.kv_index.feed_kv_events
        self.views = {n: WorkerView(n, "prefill", healthy=False, index=self.kv_index) for n in prefill} | \
            {n: WorkerView(n, "decode", healthy=False, index=self.kv_index) for n in decode}
        self.health = {n: WorkerHealth(n, stall_s=config.stall_timeout_s) for n in self.views}
        self.latest: dict[str, WorkerStats] = {}     # worker -> the newest stats read (polled or pushed)
        self._routable_changed = asyncio.Event()
        self.closed = False

    def healthy(self, role: str) -> list[WorkerView]:
        return [v for v in self.views.values() if v.role == role and v.healthy]

    @property
    def ready(self) -> bool:
        """Every worker has loaded and been handshaken at least once (gRPC health: SERVING)."""
        return all(v.healthy for v in self.views.values())

    def worker_polled(self, name: str, stats: WorkerStats) -> None:
        """A stats poll answered (or stats pushed): the routing view's load figures, and the worker's
        health. Stats older than the ones already read (a poll answered before a push) are dropped."""
        if not stats.supersedes(self.latest.get(name)):
            return
        self.latest[name] = stats
        first_start = self.health[name].incarnation is None
        change = self.health[name].observe(stats)
        view = self.views[name]
        if change is Change.NEW_INCARNATION:
            view.cached.clear()            # a restarted worker's prefix cache is empty
        if change is not Change.NONE:
            # A worker's first incarnation is the cluster starting, not news an operator must act on.
            (log.info if first_start else log.warning)("worker %s: %s (now %s)", name, change.value,
                                                       self.health[name].state.value)
        self.update_stats(stats)
        self._set_routable(view)

    def worker_failed(self, name: str, exc: BaseException) -> None:
        """A call to the worker raised. Only Ray's word that the actor died takes it out of routing;
        a timeout or an error of the call's own is not a dead worker."""
        if is_actor_death(exc) and self.health[name].died() is Change.DIED:
            log.warning("worker %s died (%s); routing around it until it is back", name, type(exc).__name__)
            self.kv_index.forget(name)
            self._set_routable(self.views[name])

    def update_stats(self, stats: WorkerStats) -> None:
        view = self.views.get(stats.name)
        if view is not None:
            view.blocks_free = stats.blocks_free
            view.blocks_total = stats.blocks_total
            view.running = stats.running

    def largest_decode_pool(self) -> int | None:
        """The most KV blocks a decode worker that has answered a poll holds (None: none has yet)."""
        sizes = [v.blocks_total for v in self.views.values()
                 if v.role == "decode" and self.health[v.name].incarnation is not None]
        return max(sizes) if sizes else None

    async def routing_changed(self) -> None:
        """Returns at the next change of any worker's routability."""
        await self._routable_changed.wait()

    def _set_routable(self, view: WorkerView) -> None:
        routable = self.health[view.name].routable
        if routable != view.healthy:
            view.healthy = routable
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
