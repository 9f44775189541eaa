"""The admin gRPC service (`splitserve.v1.Admin`): list the workers, scale a role's pool, switch a
worker's role. The driver owns the workers, so the actions are its (`cluster/launch/admin.py`,
the `AdminControl` given here once the cluster is up); this module is their gRPC face, behind the
same API key check as the inference service (`InferenceService._authorize`).

`pool_workers` is the one reading of "which workers, in which role and state" from the router's
pool: the admin service, `ServerInfo` and the driver's list all answer with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import grpc

from proto.splitserve.v1 import inference_pb2 as pb
from router.worker_pool import WorkerPool

ADMIN_SERVICE_NAME = "splitserve.v1.Admin"


class WorkerState(Enum):
    STARTING = "starting"       # loading or being handshaken (an admin add)
    SERVING = "serving"         # routable
    DRAINING = "draining"       # leaving, or changing role: its sequences go to peers
    UNHEALTHY = "unhealthy"     # dead, restarting or stalled (router/health.py)


@dataclass(frozen=True)
class WorkerEntry:
    name: str
    role: str
    state: WorkerState
    running: int = 0

    def to_proto(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(name=self.name, role=self.role, state=self.state.value, running=self.running)


class AdminRefused(ValueError):
    """An admin action that cannot be done as asked (unknown worker, last decode worker, ...)."""


def pool_workers(pool: WorkerPool) -> list[WorkerEntry]:
    """Every worker the pool routes (or drains), by name."""
    def state(record) -> WorkerState:
        if record.draining:
            return WorkerState.DRAINING
        if record.view.healthy:
            return WorkerState.SERVING
        return WorkerState.STARTING if record.health.incarnation is None else WorkerState.UNHEALTHY
    return [WorkerEntry(n, r.view.role, state(r), r.view.running) for n, r in sorted(pool.records.items())]


class AdminControl(Protocol):
    """The driver's admin operations (cluster/launch/admin.py `ClusterAdmin`)."""

    def list_workers(self) -> list[WorkerEntry]: ...

    async def scale(self, prefill: int | None, decode: int | None, wait: bool) -> list[str]: ...

    async def switch(self, worker: str, to: str, wait: bool) -> list[str]: ...


class AdminService:
    """The Admin RPCs. `control` is set by the driver once its workers are up; a frontend without
    one (an actor frontend of --frontends N) answers FAILED_PRECONDITION."""

    def __init__(self, authorize):
        """`authorize(context)`: the inference service's API key check (aborts the call when it fails)."""
        self.authorize = authorize
        self.control: AdminControl | None = None

    async def _control(self, context) -> AdminControl:
        await self.authorize(context)
        if self.control is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "admin operations are served by the driver's frontend (--frontends 1)")
        return self.control

    async def ListWorkers(self, request, context):
        control = await self._control(context)
        return pb.ListWorkersResponse(workers=[w.to_proto() for w in control.list_workers()])

    async def Scale(self, request, context):
        control = await self._control(context)
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        actions = await self._act(context, control.scale(prefill, decode, not request.no_wait))
        return pb.ScaleResponse(actions=actions, workers=[w.to_proto() for w in control.list_workers()])

    async def SwitchRole(self, request, context):
        control = await self._control(context)
        actions = await self._act(context, control.switch(request.worker, request.to, not request.no_wait))
        return pb.SwitchRoleResponse(actions=actions, workers=[w.to_proto() for w in control.list_workers()])

    @staticmethod
    async def _act(context, action) -> list[str]:
        try:
            return await action
        except AdminRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


ADMIN_METHODS = {"ListWorkers": pb.ListWorkersRequest, "Scale": pb.ScaleRequest,
                 "SwitchRole": pb.SwitchRoleRequest}
