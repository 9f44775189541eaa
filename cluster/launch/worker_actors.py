"""The worker actors of a cluster: each one's threads and cores and the engine config every worker
runs with (its dtype and kernel plan resolved once), its class (both roles' with
`--switchable-roles`), its tensor-parallel placement group, and the setup hook that makes SIGTERM
drain it. `start_cluster` (app.py) starts them all; the admin's add starts one more (`spawn`).
"""
from __future__ import annotations

import os
import uuid
from dataclasses import replace

from cluster.config import EngineConfig, WorkerConfig
from cluster.launch.cluster_config import ClusterConfig, gpus_per_worker
from cluster.launch.switchable import SwitchableWorker
from cluster.model.kernel_choice import resolved_engine_config
from cluster.placement import CpuShare, local_worker_shares, worker_env
from cluster.secrets import Secret
from decode.spec.speculator import make_kv_only_speculator, make_speculator
from decode.worker import DecodeWorker
from prefill.worker import PrefillWorker
from router.workers import WorkerClient, WorkerRoster


def ray_module():
    """Ray, imported once `ray_environment` has set its RAY_* settings (it reads them at import;
    nothing in the serving packages imports it at module level)."""
    import ray  # noqa: PLC0415 - Ray reads its settings at import: only after ray_environment
    return ray


def actor_class(cls):
    """A worker class as a Ray actor with a "control" concurrency group (stats, abort, handshake)
    beside the default group that the data calls use."""
    return ray_module().remote(concurrency_groups={"control": 16})(cls)


async def start_workers(cfg: ClusterConfig) -> tuple[dict[str, WorkerClient], WorkerRoster, object]:
    """Every worker as a Ray actor (restarted by Ray when it dies), each with its threads, cores and
    the cluster's kernel plan; their clients, prefill workers first, who plays which role, and how
    one more starts (`spawn(name, role)`, the admin's add: loaded when it returns)."""
    num_prefill = 0 if cfg.colocated else cfg.num_prefill
    shares, resolved = await worker_shares_and_plan(cfg, num_prefill + cfg.num_decode)
    suffix = uuid.uuid4().hex[:6]   # actor names are unique per cluster; worker names stay readable
    secret = cfg.cluster_secret or Secret(os.urandom(32))
    workers, prefill, decode = {}, [], []
    for i, share in enumerate(shares):
        role = "prefill" if i < num_prefill else "decode"
        index = i if i < num_prefill else i - num_prefill
        name = f"colocated-{index}" if cfg.colocated else f"{role}-{index}"
        workers[name] = await _start_worker(cfg, resolved, secret, suffix, name, role, share)
        (prefill if role == "prefill" else decode).append(name)

    async def spawn(name: str, role: str) -> WorkerClient:   # an added worker: the last share's threads, unpinned
        client = await _start_worker(cfg, resolved, secret, suffix, name, role, CpuShare(shares[-1].threads, None))
        await client.stats()
        return client
    return workers, WorkerRoster(prefill=tuple(prefill), decode=tuple(decode)), spawn


async def _start_worker(cfg: ClusterConfig, resolved: EngineConfig, secret: Secret, suffix: str, name: str, role: str,
                        share: CpuShare) -> WorkerClient:
    """One worker actor of `role`: its class (both roles' with --switchable-roles), threads and cores."""
    # Every worker's speculation comes from decode.spec; a prefill worker's never proposes.
    cls, speculation = ((PrefillWorker, make_kv_only_speculator) if role == "prefill"
                        else (DecodeWorker, make_speculator))
    extra = ()
    if cfg.switchable_roles:
        cls, speculation, extra = SwitchableWorker, make_speculator, (role,)
    tp = cfg.tensor_parallel_size(role)
    engine = replace(resolved, num_threads=share.threads, cpus=share.cpus, tensor_parallel_size=tp,
                     eplb=replace(resolved.eplb, role=role))   # each role balances its own load
    wcfg = WorkerConfig(engine=engine, data_plane=cfg.data_plane, cluster_secret=secret,
                        kv_host=None if cfg.ray_address else "127.0.0.1", drain_timeout_s=cfg.drain_timeout_s)
    placement = await _rank_placement(cfg, tp)
    # Data calls (a stream lasts as long as its request) get a slot each for every request the
    # frontends may have in flight, and a margin for calls still ending; control calls have their own group.
    data_slots = cfg.admission.max_in_flight * cfg.frontends + 32
    h = actor_class(cls).options(name=f"{name}-{suffix}", num_cpus=cfg.worker_cpus,
                                 num_gpus=gpus_per_worker(cfg), max_concurrency=data_slots, max_restarts=-1,
                                 resources=cfg.prefill_resources if role == "prefill" else cfg.decode_resources,
                                 runtime_env={"env_vars": {**worker_env(share), **_sigterm_drain_hook()}},
                                 **placement).remote(name, wcfg, speculation, *extra)
    return WorkerClient(name, h)


def _sigterm_drain_hook() -> dict:
    """The env var by which Ray runs a worker process's setup hook on its main thread (Ray reads a
    `worker_process_setup_hook` of an actor's own runtime_env no further than this variable; its
    name is Ray's, looked up, and nothing is set where this Ray has none): SIGTERM drains the
    worker (cluster/worker_base.py `install_sigterm_drain`)."""
    var = getattr(ray_module()._private.ray_constants, "WORKER_PROCESS_SETUP_HOOK_ENV_VAR", None)
    return {var: "cluster.worker_base.install_sigterm_drain"} if var else {}


async def _rank_placement(cfg: ClusterConfig, tp: int) -> dict:
    """A tensor-parallel worker's placement group: one bundle per rank (`--tp-placement`, STRICT_PACK:
    one node), its rank 0 the actor in bundle 0; the followers are the actor's processes on that
    node, in the bundles reserved beside it. Nothing for a worker of one rank."""
    if tp == 1:
        return {}
    ray = ray_module()
    bundle = {"CPU": cfg.worker_cpus, **({"GPU": gpus_per_worker(cfg)} if gpus_per_worker(cfg) else {})}
    group = ray.util.placement_group([bundle] * tp, strategy=cfg.tp_placement)
    await group.ready()
    strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return {"scheduling_strategy": strategy}


async def worker_shares_and_plan(cfg: ClusterConfig, num_workers: int) -> tuple[list[CpuShare], EngineConfig]:
    """Threads and cores per worker (cluster/placement.py), and the engine config every worker
    runs with, its dtype and kernel plan resolved once: here for a local cluster, on a decode node
    by a Ray task for a remote one (the driver's CPU may not be the workers')."""
    ray = ray_module()
    if cfg.ray_address:
        shares = [CpuShare(cfg.engine.num_threads or max(1, int(cfg.worker_cpus)), None)] * num_workers
    else:
        shares = local_worker_shares(num_workers, cfg.engine.num_threads)
    if cfg.engine.kernel_plan is not None and cfg.engine.dtype != "auto":
        return shares, cfg.engine
    if not cfg.ray_address:
        return shares, resolved_engine_config(cfg.engine, shares[-1].threads)
    task = ray.remote(resolved_engine_config).options(num_cpus=cfg.worker_cpus, num_gpus=gpus_per_worker(cfg),
                                                  resources=cfg.decode_resources)
    return shares, await task.remote(cfg.engine, shares[-1].threads)
