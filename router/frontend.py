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
import gc
import logging
import os
import time
from dataclasses import dataclass, field

from router.admission import AdmissionConfig
from router.connections import ConnectionLimits
from router.router import RouterConfig

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


CONTROL = "control"     # the workers' Ray concurrency group for control calls (cluster/launch/app.py)


class RayWorkerClient:
    """The router's view of one worker actor. Data calls (prefill, generate, decode) run in the
    actor's default group; control calls in its "control" group, so that they never queue behind
    the streams."""

    def __init__(self, name: str, handle):
        self.name = name
        self.handle = handle

    def _control(self, method: str):
        return getattr(self.handle, method).options(concurrency_group=CONTROL)

    async def prefill(self, request_id, prompt_ids, sampling, forks=()):
        return await self.handle.prefill.remote(request_id, prompt_ids, sampling, forks)

    def start(self, method: str, *args, **kwargs):
        """Start a streamed request (`generate` or `decode`); its deltas come over the token stream,
        the returned ref resolves when it ends (or raises if the worker dies)."""
        return getattr(self.handle, method).remote(*args, **kwargs)

    async def abort(self, request_id):
        await self._control("abort").remote(request_id)

    async def stats(self):
        return await self._control("stats").remote()

    async def metadata(self):
        return await self._control("metadata").remote()

    async def add_peer(self, metadata: bytes):
        return await self._control("add_peer").remote(metadata)

    async def set_ready(self, incarnation: str) -> bool:
        return await self._control("set_ready").remote(incarnation)


async def poll_workers(clients: dict, timeout_s: float) -> dict:
    """Every worker's stats at once (one slow worker delays no other): name -> stats, or the
    exception its call raised (a timeout is `TimeoutError`: slow, not dead)."""
    async def one(client):
        try:
            return await asyncio.wait_for(client.stats(), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - judged by the caller (router.worker_failed)
            return exc
    results = await asyncio.gather(*(one(c) for c in clients.values()))
    return dict(zip(clients, results))


def apply_poll(router, results: dict) -> list[dict]:
    """Feed one poll round to a router's health and routing views; returns the stats that came."""
    got = []
    for name, result in results.items():
        if isinstance(result, BaseException):
            router.worker_failed(name, result)
        else:
            router.worker_polled(name, result)
            got.append(result)
    return got


@dataclass(frozen=True)
class FrontendConfig:
    """What one frontend is told, built from the cluster's config (cluster/launch/app.py): the
    settings are declared there and in the classes nested here, never restated."""
    name: str
    model_dir: str                  # the tokenizer is read from here
    limits: object                  # router.validation.Limits
    info: dict                      # ServerInfo fields
    router: RouterConfig
    transport: str                  # the KV transport (a metrics label)
    host: str
    port: int
    stream_host: str                # where workers send token frames: this node's address
    policy: str
    admission: AdmissionConfig
    connections: ConnectionLimits
    poll_timeout_s: float           # a poll slower than this is skipped (slow is not dead)
    roles: dict                     # worker name -> "prefill" | "decode"
    api_keys: tuple = ()                # cluster.secrets.ApiKey (or plain key strings)
    tls: tuple[bytes, bytes] | None = field(default=None, repr=False)   # its private key: never printed
    tls_client_ca: bytes | None = None  # mTLS: clients must present a certificate signed by this CA
    poll_stats_s: float | None = None   # poll the workers' stats itself (actor frontends)
    http_port: int | None = None        # the OpenAI-compatible HTTP API (router/http_server.py)
    http_reuse_port: bool = False       # several frontend processes share the HTTP port
    chat_template: str | None = None    # a Jinja file that overrides the model's chat template


class Frontend:
    def __init__(self, cfg: FrontendConfig, handles: dict, metrics=None):
        self.cfg = cfg
        self.handles = handles
        self.metrics = metrics
        self.siblings: list = []
        self.router = self.service = self.server = self.http = None
        self.port = 0
        self._poll_task = self._ready_task = None

    async def start(self) -> int:
        from cluster.metrics import ClusterMetrics  # noqa: PLC0415
        from cluster.model.loader import load_tokenizer  # noqa: PLC0415
        from cluster.token_stream import TokenReceiver  # noqa: PLC0415
        from router.offload import batch_tokenize  # noqa: PLC0415
        from router.policy import make_policy  # noqa: PLC0415
        from router.router import Router  # noqa: PLC0415
        from router.server import InferenceService, start_grpc_server  # noqa: PLC0415
        cfg = self.cfg
        if self.metrics is None:
            self.metrics = ClusterMetrics(cfg.transport, workers=False)
        clients = {n: RayWorkerClient(n, h) for n, h in self.handles.items()}
        prefill = {n: c for n, c in clients.items() if cfg.roles[n] == "prefill"}
        decode = {n: c for n, c in clients.items() if cfg.roles[n] == "decode"}
        receiver = TokenReceiver(cfg.name, host=cfg.stream_host)
        await receiver.start()
        self.router = Router(cfg.router, make_policy(cfg.policy), prefill, decode, receiver, metrics=self.metrics)
        tokenizer = load_tokenizer(cfg.model_dir)
        self.service = InferenceService(self.router, cfg.limits, batch_tokenize(tokenizer, add_special_tokens=True),
                                        cfg.info, cfg.api_keys, metrics=self.metrics, siblings=self,
                                        admission=cfg.admission)
        self.server, self.port = await start_grpc_server(self.service, cfg.host, cfg.port, tls=cfg.tls,
                                                         client_ca=cfg.tls_client_ca, connections=cfg.connections)
        if cfg.http_port is not None:
            from router.chat_template import ChatTemplate  # noqa: PLC0415
            from router.http_server import OpenAIServer  # noqa: PLC0415
            template = ChatTemplate.load(cfg.model_dir, cfg.chat_template)
            registry = self.metrics.registry if self.metrics.has_workers else None
            self.http = OpenAIServer(self.service, tokenizer, template, metrics_registry=registry,
                                     connections=cfg.connections)
            await self.http.start(cfg.host, cfg.http_port, reuse_port=cfg.http_reuse_port, tls=cfg.tls,
                                  client_ca=cfg.tls_client_ca)
        if cfg.poll_stats_s is not None:
            self._poll_task = asyncio.ensure_future(self._poll_stats(clients))
        self._ready_task = asyncio.ensure_future(self._serve_when_ready())
        # What start-up made (torch, the tokenizer, the servers) lives as long as the process: out
        # of the collector's sight, a full collection under a request flood walks only new objects
        # (it walked them all: /health stalled 140 ms).
        gc.collect()
        gc.freeze()
        return self.port

    async def _serve_when_ready(self) -> None:
        """gRPC health turns SERVING once every worker is routable for the first time."""
        while not self.router.ready:
            await self.router.routing_changed()
        await self.service.set_serving(True)

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        await asyncio.wait_for(asyncio.shield(self._ready_task), timeout_s)

    async def _poll_stats(self, clients: dict) -> None:
        """The routing view of an actor frontend (the driver's supervisor does reconnection)."""
        cadence = StatsCadence(busy_s=self.cfg.poll_stats_s)
        while True:
            got = apply_poll(self.router, await poll_workers(clients, self.cfg.poll_timeout_s))
            await cadence.sleep(got, self.router)

    # --- called by sibling frontends and the driver (Ray) --------------------------------------
    def set_siblings(self, siblings: list) -> None:
        self.siblings = siblings

    async def abort_local(self, request_id: str, tenant: str | None = None) -> bool:
        return await self.router.abort(request_id, tenant)

    async def abort_anywhere(self, request_id: str, tenant: str | None = None) -> bool:
        """`Abort` for a request another frontend may own (only by its tenant)."""
        if request_id in self.router.active:
            return await self.router.abort(request_id, tenant)
        found = await asyncio.gather(*(s.abort_local.remote(request_id, tenant) for s in self.siblings),
                                     return_exceptions=True)
        return any(f is True for f in found)

    def metric_samples(self) -> list:
        """This frontend's request series, as plain data for the driver's merged scrape."""
        return self.metrics.request_samples()

    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    def pid(self) -> int:
        return os.getpid()

    async def stop(self) -> None:
        """Streams in flight end with UNAVAILABLE ("shutting down"), then the server stops."""
        if self._poll_task is not None:
            self._poll_task.cancel()
        if self._ready_task is not None:
            self._ready_task.cancel()
        await self.service.set_serving(False)
        self.service.admission.close()
        await self.router.shutdown()
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace=1.0)
        await self.router.receiver.stop()
        self.service.offload.close()
