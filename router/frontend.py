"""One frontend: the gRPC server, its router and the token stream it reads.

`splitserve serve` runs one frontend in its own process by default. With `--frontends N` it runs N
of them as Ray actors (processes) on the driver's node, all serving one port (gRPC sets
SO_REUSEPORT, so the kernel spreads connections over them) and sharing the workers, as vLLM's
`--api-server-count` does. A request belongs to the frontend that accepted it; an `Abort` that
reaches another frontend is passed to its siblings. Each frontend process keeps its own
`WorkerPool` (its routing view), fed by the stats pushed to its token receiver and by one stats
poll in its process (`router/stats_poll.py`: an actor frontend runs its own; the in-process
frontend's pool is the driver's, fed by the driver's poll). Routing stays coherent across
frontends because the prefix-aware policy's affinity is a pure function of the prompt (see
`router/policy.py`).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.metrics import ClusterMetrics, SampleFamily, merged_registry
from cluster.model.tokenizer import load_tokenizer
from cluster.token_stream import TokenReceiver
from router.admission import AdmissionConfig
from router.chat_template import ChatTemplate
from router.kv_index import feed_kv_events
from router.connections import ConnectionLimits
from router.openai.http_server import OpenAIServer
from router.policy import make_policy
from router.router import Router
from router.router_config import RouterConfig
from router.served_models import ModelEntry, ServedModels
from router.skills import SkillClassifier, load_skill_routes
from router.server import InferenceService, ServerInfo, start_grpc_server
from router.tokenization import TokenCodec
from router.validation import Limits
from router.stats_poll import StatsCadence, run_stats_poll
from router.worker_pool import WorkerPool
from router.workers import WorkerClient, WorkerRoster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendConfig:
    """What one frontend is told, built from the cluster's config (cluster/launch/app.py): the
    settings are declared there and in the classes nested here, never restated."""
    name: str
    model_dir: str                  # the tokenizer is read from here
    limits: Limits
    info: ServerInfo                # what the ServerInfo RPC answers
    router: RouterConfig
    transport: str                  # the KV transport (a metrics label)
    host: str
    port: int | None                # gRPC (None: only the HTTP API)
    stream_host: str                # where workers send token frames: this node's address
    policy: str
    admission: AdmissionConfig
    connections: ConnectionLimits
    poll_timeout_s: float           # a poll slower than this is skipped (slow is not dead)
    roster: WorkerRoster            # which worker plays which role
    api_keys: tuple = ()                # cluster.secrets.ApiKey (or plain key strings)
    tls: tuple[bytes, bytes] | None = field(default=None, repr=False)   # its private key: never printed
    tls_client_ca: bytes | None = None  # mTLS: clients must present a certificate signed by this CA
    poll_stats_s: float | None = None   # run its own stats poll at this busy cadence (actor frontends)
    http_port: int | None = None        # the OpenAI-compatible HTTP API (router/openai/http_server.py)
    http_reuse_port: bool = False       # several frontend processes share the HTTP port
    chat_template: str | None = None    # a Jinja file that overrides the model's chat template
    attached: bool = False              # served through another model's frontend (router/served_models.py)
    skill_routes: str | None = None     # --skill-routes: a YAML file (router/skills.py)


class Frontend:
    def __init__(self, cfg: FrontendConfig, handles: Mapping[str, object], metrics=None,
                 workers: WorkerPool | None = None, peers: Mapping[str, "Frontend"] | None = None,
                 model_slot=None):
        """`handles`: worker name -> its Ray actor handle. `workers`: the driver's pool, when this
        frontend runs in the driver's process (the driver's stats poll feeds it, and its metrics
        read it); an actor frontend builds its own and polls for it (`cfg.poll_stats_s`). `peers`:
        the frontends of the other models this one's ports serve, by served name. `model_slot`:
        --max-loaded-models' place for each request (router/model_swap.py), given to the router."""
        self.model_slot = model_slot
        self.cfg = cfg
        self.peers = dict(peers or {})
        self.handles = handles
        self.metrics = metrics
        self.workers = workers
        self.siblings: list = []
        self.router = self.service = self.server = self.http = None
        self.port: int | None = None     # gRPC's, once bound (None: no gRPC server)
        self._poll_task = self._ready_task = self._kv_task = None

    async def start(self) -> int | None:
        """Bind the servers (health NOT_SERVING until every worker is ready); the gRPC port."""
        cfg = self.cfg
        if self.metrics is None:
            self.metrics = ClusterMetrics(cfg.transport, cfg.limits.model_id)
        if self.workers is None:
            self.workers = WorkerPool.of_roster(cfg.router, make_policy(cfg.policy),
                                                {n: WorkerClient(n, h) for n, h in self.handles.items()}, cfg.roster)
        receiver = TokenReceiver(cfg.name, host=cfg.stream_host)
        await receiver.start()
        self.router = Router(cfg.router, self.workers, receiver, metrics=self.metrics, model_slot=self.model_slot)
        tokenizer = load_tokenizer(cfg.model_dir)
        self.service = InferenceService(self.router, cfg.limits, TokenCodec(tokenizer, cfg.limits.vocab_size),
                                        cfg.info, cfg.api_keys, metrics=self.metrics, siblings=self,
                                        admission=cfg.admission)
        if cfg.port is not None:
            self.server, self.port = await start_grpc_server(self.service, cfg.host, cfg.port, tls=cfg.tls,
                                                             client_ca=cfg.tls_client_ca, connections=cfg.connections)
        if cfg.http_port is not None or cfg.attached:
            template = ChatTemplate.load(cfg.model_dir, cfg.chat_template)
            registry = self.metrics.registry if self.metrics.has_workers else None
            if self.peers and registry is not None:
                registry = merged_registry([registry, *(p.metrics.registry for p in self.peers.values())])
            self.http = OpenAIServer(self.service, tokenizer, template, metrics_registry=registry,
                                     connections=cfg.connections)
        if self.peers:
            self._serve_models()
        if cfg.http_port is not None:
            await self.http.start(cfg.host, cfg.http_port, reuse_port=cfg.http_reuse_port, tls=cfg.tls,
                                  client_ca=cfg.tls_client_ca)
        if cfg.poll_stats_s is not None:     # an actor frontend: the stats poll of its own process
            self._poll_task = asyncio.ensure_future(run_stats_poll(
                self.workers, StatsCadence(busy_s=cfg.poll_stats_s), cfg.poll_timeout_s, demand=self.router))
        self._kv_task = asyncio.ensure_future(feed_kv_events(
            self.workers.kv_index, self.workers.clients, cfg.router.kv_events_period_s, cfg.poll_timeout_s,
            lambda index: self.metrics.update_kv_index(index.samples(), index.counts)))
        self._ready_task = asyncio.ensure_future(self._serve_when_ready())
        # What start-up made (torch, the tokenizer, the servers) lives as long as the process: out
        # of the collector's sight, a full collection under a request flood walks only new objects
        # (it walked them all: /health stalled 140 ms).
        gc.collect()
        gc.freeze()
        return self.port

    def _serve_models(self) -> None:
        """This frontend's ports serve its peers' models too: each request to the stack of the model it names."""
        frontends = [self, *self.peers.values()]
        entries = [ModelEntry(f.cfg.limits.model_id, f.service, f.http, f.http is not None and
                              f.http.chat_template is not None) for f in frontends]
        routes = load_skill_routes(self.cfg.skill_routes) if self.cfg.skill_routes else None
        if routes:
            unknown = {r.model for r in routes} - {e.name for e in entries}
            if unknown:
                raise ValueError(f"--skill-routes names models not served: {', '.join(sorted(unknown))}; served: "
                                 f"{', '.join(e.name for e in entries)}")
        models = ServedModels(entries, SkillClassifier(routes) if routes else None)
        self.service.served = models
        if self.http is not None:
            self.http.served = models

    async def _serve_when_ready(self) -> None:
        """gRPC health turns SERVING once every worker is routable for the first time."""
        for router in [self.router, *(p.router for p in self.peers.values())]:
            while not router.ready:
                await router.routing_changed()
        await self.service.set_serving(True)

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        await asyncio.wait_for(asyncio.shield(self._ready_task), timeout_s)

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

    def metric_samples(self) -> tuple[SampleFamily, ...]:
        """This frontend's request series, for the driver's merged scrape."""
        return self.metrics.request_samples()

    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    def pid(self) -> int:
        return os.getpid()

    async def drain(self, timeout_s: float) -> int:
        """A graceful shutdown's first half: the Inference service's health turns NOT_SERVING (HTTP
        /health 503; the server's own, "", stays SERVING: alive, draining), new and
        queued requests are refused (UNAVAILABLE / 503, "shutting down"), and the requests in
        flight run to their end, for up to `timeout_s`. Returns the in-flight slots still held
        then (0: drained); `stop` ends those."""
        if self._ready_task is not None:
            self._ready_task.cancel()             # a server still starting never turns SERVING now
        await self.service.set_serving(False, alive=True)   # readiness fails, liveness holds
        admission = self.service.admission
        admission.close()
        log.info("draining: %d in-flight slots, up to %.0fs", admission.in_use, timeout_s)
        await admission.wait_none_held(timeout_s)
        return admission.in_use

    async def stop(self) -> None:
        """Streams in flight end with UNAVAILABLE ("shutting down"), then the server stops."""
        if self._poll_task is not None:
            self._poll_task.cancel()
        for task in (self._ready_task, self._kv_task):
            if task is not None:
                task.cancel()
        await self.service.set_serving(False)
        self.service.admission.close()
        await self.router.shutdown()
        if self.http is not None:
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        await self.router.receiver.stop()
        self.service.offload.close()
