"""Assembles the cluster: a local or existing Ray, prefill and decode workers as actors, the
router and its gRPC server. The one module (with cli.py) allowed to import every role."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.launch.admin import AdminWiring, ClusterAdmin
from cluster.kv.shared_host import segment_path
from cluster.launch.cluster_config import ClusterConfig, gpus_per_worker
from cluster.launch.planner_live import LivePlanner, start_live_planner
from cluster.launch.worker_actors import ray_module, start_workers
from cluster.metrics import ClusterMetrics, merged_registry
from cluster.model.tokenizer import load_tokenizer
from cluster.model.model_config import load_model_config
from cluster.model.quantize import Quantization, check_quantization
from cluster.secrets import as_api_keys
from cluster.version import splitserve_version
from cluster.worker_messages import WorkerStats
from decode.spec.compat import check_speculative_models, weights_fingerprint
from decode.spec.online.service import OnlineTrainerService
from router.frontend import Frontend, FrontendConfig
from router.health import is_actor_death
from router.policy import make_policy
from router.server import ServerInfo
from router.stats_poll import PollRound, StatsCadence, apply_poll, poll_workers, run_stats_poll
from router.validation import Limits
from router.worker_pool import WorkerPool
from router.workers import WorkerClient, WorkerRoster

log = logging.getLogger(__name__)


def _max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token's text can cover (a bound for refusing an over-long text
    prompt without tokenizing it). One more than the longest token's decoded text: a SentencePiece
    token's leading space is dropped when it is decoded alone."""
    longest = 0
    for token_id in range(tokenizer.get_vocab_size()):
        longest = max(longest, len(tokenizer.decode([token_id], skip_special_tokens=False).encode()))
    return longest + 1


def _check(cfg: "ClusterConfig") -> None:
    """What the config alone cannot know (its own fields checked themselves when it was built)."""
    gpus_per_worker(cfg)
    check_quantization(Quantization(cfg.engine.quantization), cfg.engine.device.split(":")[0], cfg.engine.model)


# Ray's own timers, slowed where nothing of ours depends on them (measured with bench/idle_cpu.py:
# Ray's processes together from ~3.5% to ~1.5% of a core when idle; docs/serving.md lists the
# costs). A site's own RAY_* settings win. On an existing cluster they belong in `ray start`.
RAY_QUIET = {
    "RAY_prestart_worker_first_driver": "0",          # our actors all set a runtime_env: never used
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",                # new log files noticed within 5 s (log_to_driver is off)
    "RAY_object_manager_timer_freq_ms": "1000",       # our KV never travels as Ray objects
    "RAY_local_fs_monitor_interval_ms": "1000",
    "RAY_kill_idle_workers_interval_ms": "1000",
    "RAY_io_context_monitor_probe_interval_ms": "10000",
}


def ray_environment(joining: bool = False, token_file: str | None = None) -> None:
    """Ray settings: token authentication on (a site's own RAY_AUTH_MODE wins), local clusters kept
    on loopback (Ray rewrites 127.0.0.1 otherwise) and its idle timers quiet.

    Whoever reaches a Ray cluster's GCS unauthenticated can run code in it, and every API key and
    the KV plane's secret are behind it. A local cluster gets a random token of its own (nothing
    outside this process tree knows it); joining one (`--ray-address`) needs the token it was
    started with: `--ray-token-file`, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if token_file:    # the file wins over a token this process may have inherited
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"{token_file}: the Ray token file is empty")
        os.environ["RAY_AUTH_TOKEN"] = token
    mode = os.environ["RAY_AUTH_MODE"]
    has_token = bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"))
    if mode == "token" and not has_token:
        if joining:
            raise ValueError("joining a Ray cluster needs its authentication token: give --ray-token-file FILE "
                             "(or set RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH); RAY_AUTH_MODE=disabled connects to a "
                             "cluster without authentication, where anyone who reaches its ports can run code")
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    elif mode != "token" and joining:
        log.warning("RAY_AUTH_MODE=%s: the Ray cluster is not authenticated; anyone who reaches its GCS, client or "
                    "dashboard port can run code in it (docs/security.md)", mode)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for key, value in RAY_QUIET.items():
        os.environ.setdefault(key, value)
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        # Ray was imported before these were set (a library user, a test): it caches its config and
        # token at import; refresh both, as Ray itself does when it turns token auth on.
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


@dataclass
class RunningCluster:
    config: ClusterConfig
    frontend: Frontend | None   # the in-process frontend; None with --frontends N > 1
    frontends: list             # actor frontends' handles (with --frontends N > 1)
    port: int | None            # the gRPC API's, as bound (None: not served)
    workers: dict[str, WorkerClient]
    started_ray: bool
    supervisor: object
    metrics: object = None
    metrics_server: object = None
    http_port: int | None = None    # the OpenAI HTTP API's port, when served
    model_name: str = ""            # the served model's name in both APIs (--served-model-name, else its id)
    first_stats: tuple[WorkerStats, ...] = ()   # every worker's first WorkerStats, once loaded (its KV pool as planned)
    max_model_len: int = 0          # the longest prompt plus completion a request may have
    online_trainer: object = None   # --spec-online: the trainer actor (decode/spec/online/service.py)
    models: tuple = ()              # the other models' clusters, served through this one's ports (models.py)
    admin: ClusterAdmin | None = None   # the admin operations (None: colocated, or --frontends N)
    planner: LivePlanner | None = None  # --planner sla (cluster/launch/planner_live.py)

    @property
    def router(self):
        return self.frontend.router

    @property
    def service(self):
        return self.frontend.service

    def frontend_pids(self) -> list[int]:
        """The processes that serve gRPC (for benchmarks of the router's own CPU)."""
        return [os.getpid()] if self.frontend else ray_module().get([f.pid.remote() for f in self.frontends])

    async def drain(self, timeout_s: float) -> int:
        """Stop taking requests and let those in flight end, within `timeout_s` (Frontend.drain,
        on every frontend at once); the in-flight slots still held then (0: all ended)."""
        if self.frontend is not None:
            return await self.frontend.drain(timeout_s)
        left = await asyncio.gather(*(f.drain.remote(timeout_s) for f in self.frontends))
        return sum(left)

    async def stop(self) -> None:
        self.supervisor.cancel()
        if self.planner is not None:
            await asyncio.to_thread(self.planner.stop)
        if self.admin is not None:
            await self.admin.close()
        if self.frontend is not None:
            await self.frontend.stop()
        ray = ray_module()
        for f in self.frontends:
            try:
                await f.stop.remote()
                ray.kill(f)
            except Exception:  # noqa: BLE001
                pass
        if self.metrics_server is not None:
            self.metrics_server[0].shutdown()
        for actor in [*([self.online_trainer] if self.online_trainer is not None else []),
                      *(c.handle for c in self.workers.values())]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        if self.config.engine.cache.kv_host_shared:
            # The node's shared host tier outlives killed workers (a restarted one finds it), not the cluster.
            segment_path(self.config.engine.cache.kv_host_shared).unlink(missing_ok=True)
        for other in self.models:       # the other models' clusters (Ray ends below, with this one)
            await other.stop()
        if self.started_ray:
            ray.shutdown()


PEER_CALL_S = 5.0       # a live peer answers a control call within this; one that does not is skipped


async def _handshake(name: str, workers: dict[str, WorkerClient], roster: WorkerRoster, metas: dict,
                     alive: set | None = None) -> list[str]:
    """(Re)connect one worker with every worker of the other role: transport metadata both ways,
    each peer's fetched afresh (a worker restarted by Ray comes back with a new agent; `metas`
    keeps the last seen). Adding the same metadata twice is a no-op on the worker
    (`EngineWorker.add_peer`), so pulls in flight to a live peer survive.
    A peer that cannot be reached now (not in `alive`: its last poll failed; or slow to answer) is
    skipped and named in the result: its own bring-up connects the two when it is back, so no
    worker waits on a peer that is restarting. Raises only when `name` itself fails. A prefill
    worker is also given every decode worker's actor handle (valid across their restarts): it hands
    its requests on to them itself."""
    metas[name] = await workers[name].metadata()
    if roster.role_of(name) == "prefill":
        await workers[name].hand_on_to({d: workers[d].handle for d in roster.decode})
    skipped = []
    for other, client in workers.items():
        if roster.role_of(other) == roster.role_of(name):
            continue
        if alive is not None and other not in alive:
            skipped.append(other)
            continue
        try:
            metas[other] = await asyncio.wait_for(client.metadata(), PEER_CALL_S)
            await asyncio.wait_for(client.add_peer(metas[name]), PEER_CALL_S)
        except Exception as exc:  # noqa: BLE001 - the peer's problem, not this worker's
            log.info("handshake %s -> %s skipped (%s)", name, other, type(exc).__name__)
            skipped.append(other)
            continue
        try:
            await workers[name].add_peer(metas[other])
        except Exception as exc:  # noqa: BLE001
            if is_actor_death(exc):
                raise
            log.info("handshake %s <- %s skipped (%s)", name, other, type(exc).__name__)
            skipped.append(other)
    return skipped


async def _bring_up(name: str, incarnation: str | None, workers: dict[str, WorkerClient], roster: WorkerRoster, metas: dict,
                    peers: set, unpaired: dict) -> None:
    """Handshake `name` with `peers` (the live ones), remember those it could not reach
    (`unpaired`, retried while both live), and, for a worker that is not ready yet (just started,
    or restarted by Ray as a new incarnation), tell it it may take work."""
    try:
        if roster.disaggregated:
            skipped = set(await _handshake(name, workers, roster, metas, peers))
            if incarnation is not None:      # a new incarnation: every peer it missed
                unpaired[name] = skipped
            else:                            # a retry of some: those still missed
                unpaired[name] = (unpaired.get(name, set()) - peers) | (skipped & peers)
        if incarnation is not None:
            await workers[name].set_ready(incarnation)
    except Exception as exc:  # noqa: BLE001 - retried at the next poll
        log.warning("bringing up worker %s failed (%s); retrying", name, exc)


class _Supervisor:
    """What the driver does with each round of its stats poll (`run_stats_poll`'s `on_round`): the
    bring-up of a worker that answers not ready (started again by Ray, a new incarnation), and the
    handshakes a worker missed, retried while both ends live. It reads liveness from the pool's
    records; a slow poll is skipped, never a verdict."""

    def __init__(self, pool: WorkerPool, workers: dict[str, WorkerClient], roster: WorkerRoster, metas: dict,
                 alive_s: float):
        """`alive_s`: a worker heard from (polled or pushed) within this lives."""
        self.pool, self.workers, self.roster, self.metas, self.alive_s = pool, workers, roster, metas, alive_s
        self.pending: dict[str, asyncio.Task] = {}
        self.unpaired: dict[str, set[str]] = {}     # worker -> peers its last handshake could not reach

    def __call__(self, poll: PollRound) -> None:
        alive = self._alive(poll)
        for name, stats in poll.stats.items():
            if not stats.ready and not self._bringing_up(name):
                log.warning("worker %s (incarnation %s) is up; connecting its peers", name, stats.incarnation[:8])
                self._bring_up(name, stats.incarnation, alive - {name})
        for name in alive:       # every round, polled or not: a ready worker unpaired with a live peer
            if self.unpaired.get(name, set()) & alive and not self._bringing_up(name):
                self._bring_up(name, None, self.unpaired[name] & alive)

    def _bring_up(self, name: str, incarnation: str | None, peers: set[str]) -> None:
        self.pending[name] = asyncio.ensure_future(
            _bring_up(name, incarnation, self.workers, self.roster, self.metas, peers, self.unpaired))

    def _bringing_up(self, name: str) -> bool:
        return name in self.pending and not self.pending[name].done()

    def _alive(self, poll: PollRound) -> set[str]:
        """The workers heard from lately (this round, or pushed: their stats are fresh), and whose
        poll did not fail this round."""
        now = time.monotonic()
        return {n for n, r in self.pool.records.items()
                if r.heard_at is not None and now - r.heard_at < self.alive_s and n not in poll.failed}


def _log_router_node(ray) -> None:
    """The router runs in this driver process. On a multi-node cluster it belongs on the head: Ray
    attaches a driver to the head when the head runs on this host, so start `serve` there."""
    me = ray.get_runtime_context().get_node_id()
    head = any(n["NodeID"] == me and "node:__internal_head__" in n["Resources"] for n in ray.nodes())
    (log.info if head else log.warning)("router on Ray node %s (%s)", me, "the head" if head else "not the head")


async def start_cluster(cfg: ClusterConfig, peers: dict | None = None, attached: bool = False,
                        model_slot=None) -> RunningCluster:
    """Ray, the workers, the frontends (their ports bound, health NOT_SERVING), then every worker
    loaded, handshaken and ready (health SERVING), and the supervisor that keeps them so.

    Several models (cluster/launch/models.py): `attached`, a model served through another's ports
    (its frontend binds none); `peers`, the attached models' frontends by served name, that the
    frontend owning the ports hands their requests to. `model_slot`: --max-loaded-models' place for
    each request (cluster/launch/model_swap.py)."""
    # Refuse a speculative setup that cannot work (or cannot cross the handoff) before any model loads.
    check_speculative_models(cfg.engine, disaggregated=not cfg.colocated)
    _check(cfg)
    log.info("starting Ray", extra={"phase": "starting Ray"})
    started = _start_ray(cfg)
    ray = ray_module()
    workers, roster, spawn = await start_workers(cfg)
    log.info("starting %d workers", len(workers), extra={"phase": f"loading the model in {len(workers)} workers"})
    fcfg = _frontend_config(cfg, _limits(cfg), _server_info(cfg, roster), roster,
                            stream_host=ray.util.get_node_ip_address())
    if attached:
        fcfg = replace(fcfg, port=None, http_port=None, attached=True)
    frontend, actors, port, pool, metrics = await _start_frontend_processes(cfg, fcfg, workers, peers or {},
                                                                            model_slot)
    metas: dict[str, bytes] = {}
    first_stats = await _first_bring_up(workers, roster, metas, frontend, actors)
    cadence = StatsCadence()     # the driver's one stats poll (actor frontends run their own)
    supervision = _Supervisor(pool, workers, roster, metas, alive_s=2 * cadence.idle_s)
    supervisor = asyncio.ensure_future(run_stats_poll(
        pool, cadence, fcfg.poll_timeout_s, demand=frontend.router if frontend else None, on_round=supervision))
    admin = _admin(cfg, spawn, workers, metas, supervision, pool, frontend, metrics)
    planner = start_live_planner(cfg.planner, admin, metrics)
    served = merged_registry([metrics.registry, *(f.metrics.registry for f in (peers or {}).values())])
    metrics_server = (metrics.serve(cfg.metrics_port, cfg.metrics_host or cfg.host, served if peers else None)
                      if cfg.metrics_port is not None and not attached else None)
    http_port = frontend.http_port() if frontend is not None else (
        await actors[0].http_port.remote() if actors else None)
    trainer = await _start_online_trainer(cfg, workers, roster) if cfg.engine.speculative.spec_online else None
    return RunningCluster(cfg, frontend, actors, port, workers, started, supervisor, metrics, metrics_server, http_port,
                          fcfg.limits.model_id, first_stats, fcfg.limits.max_model_len, trainer, admin=admin,
                          planner=planner)


def _admin(cfg: ClusterConfig, spawn, workers: dict[str, WorkerClient], metas: dict, supervision: _Supervisor,
           pool: WorkerPool, frontend: Frontend | None, metrics) -> ClusterAdmin | None:
    """The admin operations, served by the in-process frontend's Admin RPCs (an actor frontend's
    router is not the driver's: none there)."""
    if frontend is None or cfg.colocated:
        return None

    async def connect(name: str, roster: WorkerRoster) -> None:
        await _handshake(name, workers, roster, metas)

    async def pair(name: str, peers: list[str]) -> None:     # transport peers both ways (a KV move's)
        metas[name] = await workers[name].metadata()
        for other in peers:
            metas[other] = await workers[other].metadata()
            await workers[name].add_peer(metas[other])
            await workers[other].add_peer(metas[name])
    wiring = AdminWiring(spawn=spawn, connect=connect, pair=pair, set_role=lambda client, role: client.set_role(role),
                         kill=lambda client: ray_module().kill(client.handle), switchable=cfg.switchable_roles)
    admin = ClusterAdmin(wiring, workers, supervision, pool, frontend.router, metrics, cfg.drain_timeout_s)
    frontend.service.admin.control = admin
    pool.on_leaving = admin.leave      # at the first stats that say so, pushed or polled
    return admin


async def _start_online_trainer(cfg: ClusterConfig, workers: dict[str, WorkerClient], roster: WorkerRoster):
    """--spec-online's trainer: beside the decode workers, on no CPU of its own (it runs niced)."""
    ray = ray_module()
    model = Path(cfg.engine.model)
    handles = {name: workers[name].handle for name in roster.decode}
    # Restarted by Ray if it dies: it starts over from the base heads (service.py `_resync`).
    trainer = ray.remote(OnlineTrainerService).options(num_cpus=0, max_concurrency=4, max_restarts=-1).remote(
        cfg.engine, handles, model, cfg.engine.speculative.eagle_dir_for(model), weights_fingerprint(model))
    await trainer.start.remote()
    return trainer


def _start_ray(cfg: ClusterConfig) -> bool:
    """Join `--ray-address`, or start a local cluster on loopback; True when this process started it."""
    ray_environment(joining=bool(cfg.ray_address), token_file=cfg.ray_token_file)
    ray = ray_module()
    if ray.is_initialized():
        return False
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=False)
        _log_router_node(ray)
    else:
        ranks = cfg.num_prefill * cfg.tensor_parallel_size("prefill") + cfg.num_decode * cfg.tensor_parallel_size("decode")
        start_local_ray(max(16, int(ranks * cfg.worker_cpus) + 1))
    return True


def start_local_ray(num_cpus: int) -> None:
    """A local Ray on loopback, without its dashboard (`ray_environment` first); `num_cpus` is
    logical: what the actors' `num_cpus` draw from."""
    ray_module().init(address="local", include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
                num_cpus=num_cpus)


def _limits(cfg: ClusterConfig) -> Limits:
    """What a request may ask for, from the model's config and the cluster's settings."""
    mc = load_model_config(cfg.engine.model)
    spec = cfg.engine.speculative
    return Limits(model_id=cfg.served_model_name or mc.model_id, vocab_size=mc.vocab_size,
                  max_model_len=cfg.engine.max_model_len or mc.max_position_embeddings,
                  max_tokens_limit=cfg.max_tokens_limit,
                  spec_methods=tuple(dict.fromkeys(("off", "ngram", "jacobi", spec.method))),
                  max_speculative_tokens=spec.max_speculative_tokens,
                  default_max_tokens=min(cfg.default_max_tokens, cfg.max_tokens_limit), bounds=cfg.bounds,
                  max_token_bytes=_max_token_bytes(load_tokenizer(cfg.engine.model)))


def _server_info(cfg: ClusterConfig, roster: WorkerRoster) -> ServerInfo:
    spec = cfg.engine.speculative
    return ServerInfo(version=splitserve_version(), mode="colocated" if cfg.colocated else "disaggregated",
                      prefill_workers=len(roster.prefill), decode_workers=len(roster.decode),
                      kv_transport=cfg.data_plane.transport, max_tokens_limit=cfg.max_tokens_limit,
                      speculative=spec.method, num_speculative_tokens=str(spec.num_speculative_tokens),
                      deterministic=cfg.engine.deterministic)


async def _start_frontend_processes(cfg: ClusterConfig, fcfg: FrontendConfig, workers: dict[str, WorkerClient],
                                    peers: dict, model_slot=None
                                    ) -> tuple[Frontend | None, list, int, WorkerPool, ClusterMetrics]:
    """The frontend in this process, or `--frontends N` actors; their port bound (health
    NOT_SERVING: requests wait); the driver's `WorkerPool` (the in-process frontend's, else its
    own) and the metrics registry this driver serves, reading the workers' series from it."""
    handles = {n: c.handle for n, c in workers.items()}
    model_name = fcfg.limits.model_id          # the served name: a label of every series
    pool = WorkerPool.of_roster(fcfg.router, make_policy(fcfg.policy), workers, fcfg.roster)
    if cfg.frontends == 1:
        metrics = ClusterMetrics(cfg.data_plane.transport, model_name, workers=pool)
        frontend = Frontend(fcfg, handles, metrics=metrics, workers=pool, peers=peers, model_slot=model_slot)
        return frontend, [], await frontend.start(), pool, metrics
    actors, port = await _start_frontends(cfg, fcfg, handles)
    return None, actors, port, pool, ClusterMetrics(cfg.data_plane.transport, model_name, workers=pool,
                                                    frontends=actors)


async def _first_bring_up(workers: dict[str, WorkerClient], roster: WorkerRoster, metas: dict,
                          frontend: Frontend | None, actors: list) -> tuple[WorkerStats, ...]:
    """Every worker loads (its first stats answer), every prefill worker is handshaken with every
    decode worker, all are marked ready, and the frontends see them routable. Returns those first
    stats (each worker's KV pool as planned, for the banner)."""
    first = await asyncio.gather(*(c.stats() for c in workers.values()))
    for p in roster.prefill:
        await _handshake(p, workers, roster, metas)
    await asyncio.gather(*(workers[s.name].set_ready(s.incarnation) for s in first))
    if frontend is not None:
        apply_poll(frontend.workers, await poll_workers(workers, 60.0))
        await frontend.wait_ready()
    else:
        await asyncio.gather(*(f.wait_ready.remote() for f in actors))
    return tuple(first)


def _frontend_config(cfg: ClusterConfig, limits: Limits, info: ServerInfo, roster: WorkerRoster,
                     stream_host: str) -> FrontendConfig:
    """What one frontend is told: the cluster's settings, none of them restated."""
    router = replace(cfg.router, block_size=cfg.engine.cache.block_size, colocated=cfg.colocated)
    return FrontendConfig(name="frontend-0", model_dir=str(cfg.engine.model), limits=limits, info=info, router=router,
                          transport=cfg.data_plane.transport, host=cfg.host, port=cfg.port, stream_host=stream_host,
                          policy=cfg.policy, admission=cfg.admission, connections=cfg.connections,
                          api_keys=as_api_keys(cfg.api_keys), tls=cfg.tls, tls_client_ca=cfg.tls_client_ca,
                          roster=roster, poll_timeout_s=cfg.poll_timeout_s, http_port=cfg.http_port,
                          http_reuse_port=cfg.frontends > 1, chat_template=cfg.chat_template,
                          skill_routes=cfg.skill_routes)


async def _start_frontends(cfg: ClusterConfig, fcfg: FrontendConfig, handles: dict) -> tuple[list, int]:
    """N frontend processes on this node, one port: the first binds it (or picks it, for port 0),
    the others join it (SO_REUSEPORT)."""
    ray = ray_module()
    here = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actors, port, http_port = [], cfg.port, cfg.http_port
    for i in range(cfg.frontends):
        f = ray.remote(Frontend).options(num_cpus=0, max_concurrency=1000, scheduling_strategy=here).remote(
            replace(fcfg, name=f"frontend-{i}", port=port, poll_stats_s=0.25, http_port=http_port), handles)
        port = await f.start.remote()
        if http_port is not None:
            http_port = await f.http_port.remote()   # the first picks it (for port 0), the others join
        actors.append(f)
    for f in actors:
        await f.set_siblings.remote([o for o in actors if o is not f])
    return actors, port
