"""One frontend: the gRPC server, its router and the token stream it reads.

`splitserve serve` runs one frontend in its own process by default. With `--frontends N` it runs N
of them as Ray actors (processes) on the driver's node, all serving one port (gRPC sets
SO_REUSEPORT, so the kernel spreads connections over them) and sharing the workers, as vLLM's
`--api-server-count` does. A request belongs to the frontend that accepted it; an `Abort` that
reaches another frontend is passed to its siblings; each frontend polls the workers' stats for its
own routing view, and routing stays coherent across frontends because the prefix-aware policy's
affinity is a pure function of the prompt (see `router/policy.py`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class StatsCadence:
    """How often to poll the workers' stats: fast while the cluster has work (or had it in the last
    `linger_s`), slowly when idle. Routing needs fresh load figures under load; an idle cluster
    should not wake every worker (and Ray's io threads) several times a second for nothing."""

    def __init__(self, busy_s: float = 0.25, idle_s: float = 2.0, linger_s: float = 5.0):
        self.busy_s, self.idle_s, self.linger_s = busy_s, idle_s, linger_s
        self.last_busy = time.monotonic()

    async def sleep(self, stats: list[dict], router=None) -> None:
        """Sleep until the next poll is due, or until `router` takes a new request."""
        period = self.next(stats, router.in_flight if router is not None else 0)
        if router is None:
            await asyncio.sleep(period)
            return
        router.activity.clear()
        try:
            await asyncio.wait_for(router.activity.wait(), timeout=period)
        except asyncio.TimeoutError:
            pass

    def next(self, stats: list[dict], in_flight: int = 0) -> float:
        now = time.monotonic()
        if in_flight or any(s["running"] or s["waiting"] or s["blocks_used"] or s.get("leases") for s in stats):
            self.last_busy = now
        return self.busy_s if now - self.last_busy < self.linger_s else self.idle_s


class RayWorkerClient:
    """The router's view of one worker actor."""

    def __init__(self, name: str, handle):
        self.name = name
        self.handle = handle

    async def prefill(self, request_id, prompt_ids, sampling):
        return await self.handle.prefill.remote(request_id, prompt_ids, sampling)

    def start(self, method: str, *args, **kwargs):
        """Start a streamed request (`generate` or `decode`); its deltas come over the token stream,
        the returned ref resolves when it ends (or raises if the worker dies)."""
        return getattr(self.handle, method).remote(*args, **kwargs)

    async def abort(self, request_id):
        await self.handle.abort.remote(request_id)

    async def stats(self):
        return await self.handle.stats.remote()


@dataclass(frozen=True)
class FrontendConfig:
    name: str
    model_dir: str                  # the tokenizer is read from here
    limits: object                  # router.validation.Limits
    info: dict                      # ServerInfo fields
    host: str = "127.0.0.1"
    port: int = 50051
    stream_host: str = "127.0.0.1"  # where workers send token frames: this node's address
    policy: str = "prefix_aware"
    block_size: int = 16
    colocated: bool = False
    local_prefill_max_tokens: int = 32
    max_in_flight: int = 256
    api_keys: tuple[str, ...] = ()
    tls: tuple[bytes, bytes] | None = None
    transport: str = "nixl"
    poll_stats_s: float | None = None   # poll the workers' stats itself (actor frontends)
    roles: dict = field(default_factory=dict)   # worker name -> "prefill" | "decode"


class Frontend:
    def __init__(self, cfg: FrontendConfig, handles: dict, metrics=None):
        self.cfg = cfg
        self.handles = handles
        self.metrics = metrics
        self.siblings: list = []
        self.router = self.service = self.server = None
        self.port = 0
        self._poll_task = None

    async def start(self) -> int:
        from cluster.metrics import ClusterMetrics  # noqa: PLC0415
        from cluster.model.loader import load_tokenizer  # noqa: PLC0415
        from cluster.token_stream import TokenReceiver  # noqa: PLC0415
        from router.policy import make_policy  # noqa: PLC0415
        from router.router import Router, RouterConfig  # noqa: PLC0415
        from router.server import InferenceService, start_grpc_server  # noqa: PLC0415
        cfg = self.cfg
        if self.metrics is None:
            self.metrics = ClusterMetrics(cfg.transport, workers=False)
        clients = {n: RayWorkerClient(n, h) for n, h in self.handles.items()}
        prefill = {n: c for n, c in clients.items() if cfg.roles[n] == "prefill"}
        decode = {n: c for n, c in clients.items() if cfg.roles[n] == "decode"}
        receiver = TokenReceiver(cfg.name, host=cfg.stream_host)
        await receiver.start()
        self.router = Router(RouterConfig(block_size=cfg.block_size, colocated=cfg.colocated,
                                          local_prefill_max_tokens=cfg.local_prefill_max_tokens,
                                          max_in_flight=cfg.max_in_flight), make_policy(cfg.policy), prefill, decode,
                             receiver, metrics=self.metrics)
        tokenizer = load_tokenizer(cfg.model_dir)
        self.service = InferenceService(self.router, cfg.limits, lambda t: tokenizer.encode(t, add_special_tokens=True).ids,
                                        cfg.info, cfg.api_keys, metrics=self.metrics, siblings=self)
        self.server, self.port = await start_grpc_server(self.service, cfg.host, cfg.port, tls=cfg.tls)
        if cfg.poll_stats_s is not None:
            self._poll_task = asyncio.ensure_future(self._poll_stats(clients))
        return self.port

    async def _poll_stats(self, clients: dict) -> None:
        """The routing view of an actor frontend (the driver's supervisor does reconnection)."""
        async def one(name, client):
            try:
                stats = await asyncio.wait_for(client.stats(), timeout=5)
            except Exception:  # noqa: BLE001 - a dead or restarting worker
                stats = None
            self.router.worker_polled(name, stats)
            return stats
        cadence = StatsCadence(busy_s=self.cfg.poll_stats_s)
        while True:
            stats = await asyncio.gather(*(one(n, c) for n, c in clients.items()))
            await cadence.sleep([s for s in stats if s], self.router)

    # --- called by sibling frontends and the driver (Ray) --------------------------------------
    def set_siblings(self, siblings: list) -> None:
        self.siblings = siblings

    async def abort_local(self, request_id: str) -> bool:
        return await self.router.abort(request_id)

    async def abort_anywhere(self, request_id: str) -> bool:
        """`Abort` for a request another frontend may own."""
        if request_id in self.router.active:
            return await self.router.abort(request_id)
        found = await asyncio.gather(*(s.abort_local.remote(request_id) for s in self.siblings),
                                     return_exceptions=True)
        return any(f is True for f in found)

    def metric_samples(self) -> list:
        """This frontend's request series, as plain data for the driver's merged scrape."""
        return self.metrics.request_samples()

    def pid(self) -> int:
        return os.getpid()

    async def stop(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
        await self.server.stop(grace=1.0)
        await self.router.receiver.stop()
