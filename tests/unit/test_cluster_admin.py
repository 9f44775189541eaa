"""The driver's admin operations (cluster/launch/admin.py `ClusterAdmin`) as policy: which workers
an action adds, removes or refuses, names never reused, and what the router's pool and the roster
say after. Fake workers and a fake router; the live path (Ray, moves under load) is
tests/e2e/test_scaling.py."""
from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

import pytest

from cluster.launch.admin import AdminWiring, ClusterAdmin
from cluster.worker_messages import StatsSource, WorkerStats
from proto.splitserve.v1 import inference_pb2 as pb
from router.admin_service import AdminRefused, AdminService, WorkerState
from router.policy import make_policy
from router.router import RouterConfig
from router.worker_pool import WorkerPool
from router.workers import WorkerRoster

INCARNATIONS = itertools.count()


class FakeWorker:
    def __init__(self, name: str, role: str):
        self.name, self.role, self.handle = name, role, object()
        self.incarnation = str(next(INCARNATIONS))
        self.handed_on: dict = {}

    async def stats(self) -> WorkerStats:
        return WorkerStats(name=self.name, role=self.role, incarnation=self.incarnation, ready=True,
                           taken_at=time.monotonic())

    async def set_ready(self, incarnation: str) -> bool:
        return True

    async def hand_on_to(self, decode_workers: dict) -> None:
        self.handed_on.update(decode_workers)


async def _admin(switchable: bool = False):
    workers = {n: FakeWorker(n, n.split("-")[0]) for n in ("prefill-0", "decode-0", "decode-1")}
    roster = WorkerRoster(prefill=("prefill-0",), decode=("decode-0", "decode-1"))
    pool = WorkerPool.of_roster(RouterConfig(), make_policy("least_loaded"), workers, roster)
    killed, roles = [], {}

    async def spawn(name: str, role: str) -> FakeWorker:
        return FakeWorker(name, role)

    async def connect(name: str, roster: WorkerRoster) -> None:
        pass

    async def pair(name: str, peers: list[str]) -> None:
        pass

    async def set_role(client, role: str) -> None:
        roles[client.name] = client.role = role
    wiring = AdminWiring(spawn=spawn, connect=connect, pair=pair, set_role=set_role, kill=killed.append,
                         switchable=switchable)
    router = SimpleNamespace(active={}, attempts=SimpleNamespace(live={}, drain=lambda name: 0))
    supervisor = SimpleNamespace(roster=roster)
    admin = ClusterAdmin(wiring, workers, supervisor, pool, router, None, drain_timeout_s=5.0)
    for w in workers.values():
        pool.observe(await w.stats(), StatsSource.POLL, time.monotonic())
    return admin, pool, supervisor, workers, killed


def _listed(admin) -> dict[str, tuple[str, WorkerState]]:
    return {w.name: (w.role, w.state) for w in admin.list_workers()}


def test_scale_adds_new_names_and_removes_the_least_loaded_decode_worker():
    async def go():
        admin, pool, supervisor, workers, killed = await _admin()
        assert _listed(admin) == {"prefill-0": ("prefill", WorkerState.SERVING),
                                  "decode-0": ("decode", WorkerState.SERVING),
                                  "decode-1": ("decode", WorkerState.SERVING)}
        assert await admin.scale(None, 3) == ["add decode-2 (decode)"]
        assert supervisor.roster.decode == ("decode-0", "decode-1", "decode-2")
        assert "decode-2" in workers["prefill-0"].handed_on          # the prefill worker hands on to it
        pool.records["decode-0"].view.running = 2
        pool.records["decode-2"].view.running = 1
        assert await admin.scale(None, 2) == ["remove decode-1 (decode)"]    # the idlest leaves
        assert [k.name for k in killed] == ["decode-1"] and "decode-1" not in pool.records
        assert supervisor.roster.decode == ("decode-0", "decode-2")
        assert await admin.scale(None, 3) == ["add decode-3 (decode)"]       # decode-1 is not given again
        assert await admin.scale(None, 3) == []
    asyncio.run(go())


def test_refusals_name_what_is_wrong():
    async def go():
        admin, *_ = await _admin()
        with pytest.raises(AdminRefused, match="at least one prefill"):
            await admin.scale(0, None)
        with pytest.raises(AdminRefused, match="--switchable-roles"):
            await admin.switch("decode-1", "prefill")
        admin, *_ = await _admin(switchable=True)
        with pytest.raises(AdminRefused, match="no worker 'decode-9'"):
            await admin.switch("decode-9", "prefill")
        with pytest.raises(AdminRefused, match="no prefill worker left"):
            await admin.switch("prefill-0", "decode")
    asyncio.run(go())


def test_a_switch_keeps_the_name_and_changes_the_role_everywhere():
    async def go():
        admin, pool, supervisor, workers, _ = await _admin(switchable=True)
        assert await admin.switch("decode-1", "prefill") == ["switch decode-1 -> prefill"]
        assert workers["decode-1"].role == "prefill" and pool.records["decode-1"].view.role == "prefill"
        assert supervisor.roster == WorkerRoster(prefill=("prefill-0", "decode-1"), decode=("decode-0",))
        assert _listed(admin)["decode-1"] == ("prefill", WorkerState.SERVING)   # out of draining, routable
    asyncio.run(go())


def test_no_wait_answers_before_the_action_is_done():
    async def go():
        admin, pool, *_ = await _admin()
        assert await admin.scale(None, 1, wait=False) == ["remove decode-1 (decode)"]
        assert "decode-1" in pool.records           # still draining
        await asyncio.gather(*admin._tasks)
        assert "decode-1" not in pool.records
    asyncio.run(go())


class _Aborted(Exception):
    pass


class FakeContext:
    async def abort(self, code, details):
        raise _Aborted(code, details)


def test_the_admin_rpcs_check_the_key_first_and_need_the_drivers_frontend():
    async def refuse(context):
        await context.abort("UNAUTHENTICATED", "missing or invalid 'authorization: Bearer <key>'")

    async def go():
        admin, *_ = await _admin()
        service = AdminService(refuse)
        service.control = admin
        with pytest.raises(_Aborted, match="UNAUTHENTICATED"):
            await service.Scale(pb.ScaleRequest(decode=1), FakeContext())
        assert "decode-1" in admin.pool.records            # nothing was done
        service = AdminService(lambda context: asyncio.sleep(0))
        with pytest.raises(_Aborted, match="--frontends 1"):
            await service.ListWorkers(pb.ListWorkersRequest(), FakeContext())
        service.control = admin
        with pytest.raises(_Aborted, match="at least one decode"):
            await service.Scale(pb.ScaleRequest(decode=0), FakeContext())
        listed = await service.ListWorkers(pb.ListWorkersRequest(), FakeContext())
        assert [(w.name, w.role, w.state) for w in listed.workers] == [
            ("decode-0", "decode", "serving"), ("decode-1", "decode", "serving"), ("prefill-0", "prefill", "serving")]
    asyncio.run(go())
