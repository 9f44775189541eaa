"""The driver's admin operations on its running cluster (the `splitserve.v1.Admin` RPCs, the
`splitserve scale` command, and the planner): add a worker of a role, remove one (drain), switch
one's role without reloading its weights.

A drain takes the worker out of routing first, then empties it: a decode worker's running
sequences are handed to peers (router/attempts.py `Attempts.drain`): with switchable workers a
greedy sequence's KV moves to another decode worker over the KV transport, as a prefill's does
(counted `moved`), any other resumes there from the tokens it streamed (`recomputed`); a prefill worker finishes what it
holds (its prefills, and the decodes it handed on, counted `finished`). A removed worker's actor is
then killed; a switched one keeps its name, engine and weights (cluster/launch/switchable.py).
Actions run one at a time (`_lock`), each logged and counted (`splitserve_scaling_actions_total`).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from cluster.worker_messages import StatsSource
from router.admin_service import AdminRefused, WorkerEntry, WorkerState, pool_workers
from router.router import Router
from router.worker_pool import WorkerPool
from router.workers import WorkerClient, WorkerRoster

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
DRAIN_POLL_S = 0.05


@dataclass(frozen=True)
class AdminWiring:
    """What the admin needs of the wiring (cluster/launch/app.py), injected: how a worker of a role
    starts, connects to its peers, changes role, and ends."""
    spawn: Callable[[str, str], Awaitable[WorkerClient]]          # (name, role) -> a loaded worker's client
    connect: Callable[[str, WorkerRoster], Awaitable[None]]       # handshake `name` with its peers in the roster
    pair: Callable[[str, list[str]], Awaitable[None]]             # transport peers both ways (decode to decode)
    set_role: Callable[[WorkerClient, str], Awaitable[None]]      # a switchable worker's new role
    kill: Callable[[WorkerClient], None]
    switchable: bool                                              # workers run cluster/launch/switchable.py


class ClusterAdmin:
    def __init__(self, wiring: AdminWiring, workers: dict[str, WorkerClient], supervisor, pool: WorkerPool,
                 router: Router, metrics, drain_timeout_s: float):
        """`workers` and `supervisor` (its `roster`) are the driver's own: changed here in place."""
        self.wiring, self.workers, self.supervisor = wiring, workers, supervisor
        self.pool, self.router, self.metrics = pool, router, metrics
        self.drain_timeout_s = drain_timeout_s
        self.starting: dict[str, str] = {}      # name -> role, for workers loading (not yet in the pool)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._leaving: set[str] = set()         # workers that got SIGTERM, their removal under way
        self._named: set[str] = set(workers)    # every name a worker has had (never given again)

    @property
    def roster(self) -> WorkerRoster:
        return self.supervisor.roster

    def list_workers(self) -> list[WorkerEntry]:
        loading = [WorkerEntry(n, role, WorkerState.STARTING) for n, role in self.starting.items()]
        return sorted([*pool_workers(self.pool), *loading], key=lambda w: w.name)

    # --- the actions -------------------------------------------------------------------------------
    async def scale(self, prefill: int | None, decode: int | None, wait: bool = True) -> list[str]:
        """Adds workers to, or drains and removes workers from, each role given, to its count."""
        plan = self._plan(prefill, decode)
        return await self._run(plan, wait)

    async def add(self, role: str) -> list[str]:
        """One more worker of `role` (the planner's add), loaded and joined when it returns."""
        if role not in ROLES:
            raise AdminRefused(f"a role is one of {ROLES}, got {role!r}")
        return await self._run([("add", self._new_name(role), role)], wait=True)

    async def remove(self, worker: str) -> list[str]:
        """`worker` drained and removed (the planner's remove), done when it returns."""
        if worker not in self.pool.records:
            raise AdminRefused(f"no worker {worker!r}; the workers: {', '.join(sorted(self.pool.records))}")
        role = self.pool.records[worker].view.role
        self._keep_one(role, 1)
        return await self._run([("remove", worker, role)], wait=True)

    async def switch(self, worker: str, to: str, wait: bool = True) -> list[str]:
        if not self.wiring.switchable:
            raise AdminRefused("switching a role needs workers that hold both roles: serve with --switchable-roles")
        if to not in ROLES:
            raise AdminRefused(f"--to is one of {ROLES}, got {to!r}")
        if worker not in self.pool.records:
            raise AdminRefused(f"no worker {worker!r}; the workers: {', '.join(sorted(self.pool.records))}")
        role = self.pool.records[worker].view.role
        if role == to:
            return []
        self._keep_one(role, 1)
        return await self._run([("switch", worker, to)], wait)

    def leave(self, name: str) -> None:
        """A worker that got SIGTERM: drained and removed, once (a drain is a removal; the pool
        shrinks until someone adds a worker). The last of its role stays until it exits."""
        if name in self._leaving or name not in self.pool.records:
            return
        self._leaving.add(name)
        role = self.pool.records[name].view.role
        log.warning("admin: %s got SIGTERM; draining and removing it", name)
        try:
            self._keep_one(role, 1)
        except AdminRefused as exc:
            log.warning("admin: %s stays until it exits: %s", name, exc)
            return
        asyncio.ensure_future(self._run([("remove", name, role)], wait=False))

    def _plan(self, prefill: int | None, decode: int | None) -> list[tuple[str, str, str]]:
        plan = []
        for role, target in (("prefill", prefill), ("decode", decode)):
            if target is None:
                continue
            names = [n for n, r in self.pool.records.items() if r.view.role == role]
            if target < 1:
                raise AdminRefused(f"a disaggregated cluster keeps at least one {role} worker, asked for {target}")
            plan += [("add", self._new_name(role), role) for _ in range(target - len(names))]
            # The least loaded leave first (fewest sequences to move); of equals, the last named.
            idle_first = sorted(sorted(names, reverse=True), key=lambda n: self.pool.records[n].view.running)
            plan += [("remove", n, role) for n in sorted(idle_first[:max(0, len(names) - target)])]
        return plan

    def _keep_one(self, role: str, leaving: int) -> None:
        if sum(r.view.role == role for r in self.pool.records.values()) - leaving < 1:
            raise AdminRefused(f"the cluster would have no {role} worker left")

    def _new_name(self, role: str) -> str:
        """`role-N`, N above every index any worker has had (names are never reused)."""
        used = [int(m.group(1)) for n in self._named if (m := re.fullmatch(r"\w+-(\d+)", n))]
        name = f"{role}-{max(used, default=-1) + 1}"
        self._named.add(name)
        return name

    async def _run(self, plan: list[tuple[str, str, str]], wait: bool) -> list[str]:
        actions = [f"{kind} {name}" + (f" -> {arg}" if kind == "switch" else f" ({arg})") for kind, name, arg in plan]
        task = asyncio.ensure_future(self._apply(plan))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if wait:
            await task
        return actions

    async def _apply(self, plan: list[tuple[str, str, str]]) -> None:
        async with self._lock:
            for kind, name, arg in plan:
                t0 = time.monotonic()
                await {"add": self._add, "remove": self._remove, "switch": self._switch}[kind](name, arg)
                log.warning("admin: %s %s %s done in %.1fs", kind, name, arg, time.monotonic() - t0)
                if self.metrics is not None:
                    self.metrics.count_scaling(kind)

    async def _add(self, name: str, role: str) -> None:
        self.starting[name] = role
        try:
            client = await self.wiring.spawn(name, role)
            self.workers[name] = client
            stats = await client.stats()
            roster = _with(self.roster, name, role)
            await self._join(name, role, roster)
            await client.set_ready(stats.incarnation)
            self.supervisor.roster = roster
            self.pool.add(name, role, client)
            self.pool.observe(await client.stats(), StatsSource.POLL, time.monotonic())
        finally:
            self.starting.pop(name, None)

    async def _join(self, name: str, role: str, roster: WorkerRoster) -> None:
        """Handshake `name` in `role` with its peers; a decode worker is also named to every prefill
        worker, which hands requests on to it."""
        await self.wiring.connect(name, roster)
        if role == "decode":
            await asyncio.gather(*(self.workers[p].hand_on_to({name: self.workers[name].handle})
                                   for p in roster.prefill))

    async def _remove(self, name: str, role: str) -> None:
        self._keep_one(role, 1)
        await self._drain(name, leaving=True)
        self.supervisor.roster = _without(self.roster, name)
        self.pool.remove(name)
        self.wiring.kill(self.workers.pop(name))

    async def _switch(self, name: str, to: str) -> None:
        await self._drain(name, leaving=False)
        roster = _with(_without(self.roster, name), name, to)
        await self.wiring.set_role(self.workers[name], to)
        await self._join(name, to, roster)
        self.supervisor.roster = roster
        self.pool.set_role(name, to)
        self.pool.set_draining(name, False)

    # --- the drain ---------------------------------------------------------------------------------
    async def _drain(self, name: str, leaving: bool) -> None:
        """Out of routing, then empty: a decode worker's sequences handed to peers, a prefill
        worker's work finished; within the drain timeout (past it, what is left fails over). A
        prefill worker that stays (a switch) need not wait for the decodes it handed on: it keeps
        waiting on them whatever its role."""
        self.pool.set_draining(name, True)
        role = self.pool.records[name].view.role
        deadline = time.monotonic() + self.drain_timeout_s
        held = self._held_by(name)
        if role == "decode" and self.wiring.switchable:     # its KV moves to the other decode workers
            await self.wiring.pair(name, [n for n in self.roster.decode if n != name])
        while time.monotonic() < deadline:
            if role == "decode":
                self.router.attempts.drain(name)
            if not await self._holds_work(name, role, leaving):
                break
            await asyncio.sleep(DRAIN_POLL_S)
        else:
            log.warning("admin: %s still held work after the %.0fs drain timeout", name, self.drain_timeout_s)
        if role == "prefill" and self.metrics is not None and held:
            self.metrics.count_drained("finished", held)

    def _held_by(self, name: str) -> int:
        return sum(name in workers for workers in self.router.active.values())

    async def _holds_work(self, name: str, role: str, leaving: bool) -> bool:
        """A prefill worker holds a request until the decode it handed on ends (it waits on it); a
        decode worker until no attempt runs there and its engine is empty (asked afresh: an abort
        lands a step later)."""
        view = self.pool.records[name].view
        if view.in_flight or self.router.attempts.live.get(name):
            return True
        if role == "prefill":
            return leaving and self._held_by(name) > 0
        try:
            stats = await self.workers[name].stats()
        except Exception as exc:  # noqa: BLE001 - it exited (SIGTERM, idle) or died: it holds nothing now
            log.info("admin: %s did not answer while draining (%s)", name, type(exc).__name__)
            return False
        return bool(stats.running or stats.waiting or stats.leases)     # leases: moved KV not yet pulled

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def _with(roster: WorkerRoster, name: str, role: str) -> WorkerRoster:
    return replace(roster, **{role: (*getattr(roster, role), name)})


def _without(roster: WorkerRoster, name: str) -> WorkerRoster:
    return WorkerRoster(prefill=tuple(n for n in roster.prefill if n != name),
                        decode=tuple(n for n in roster.decode if n != name))
