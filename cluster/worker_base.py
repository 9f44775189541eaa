"""What a prefill and a decode worker share: an engine on its own thread, a registered transport,
the transport handshake, the token streams to the frontends, and the stats the router polls (KV
usage, queues, prefix cache, and what its health is judged by: the incarnation, whether it has been
handshaken, and the engine's step counter for the progress watchdog).

The control methods (`stats`, `abort`, `metadata`, `add_peer`, `set_ready`, ...) are called in
Ray's "control" concurrency group (`cluster/launch/app.py`): they never queue behind the long streaming
calls of the data group, and none of them blocks an event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from cluster.config import EngineConfig, WorkerConfig
from cluster.engine.engine import HoldFactory, LLMEngine
from cluster.engine.engine_loop import EngineLoop
from cluster.engine.speculation import SpeculatorFactory
from cluster.engine.weight_swap import release_weights, restore_weights
from cluster.errors import RequestError, WorkerBusy
from cluster.model.moe import expert_token_counts
from cluster.kv.kv_events import KVEventBatch, KVEventLog
from cluster.parallel.expert_balancer import rank_token_counts
from cluster.token_stream import TokenSender, encode_stats
from cluster.transfer.auth import Sealer
from cluster.transfer.base import PeerMetadata, TransferError
from cluster.transfer.messages import Mailbox
from cluster.transfer.progress import KVProgress
from cluster.transfer.registry import make_transport
from cluster.types import TokenDelta
from cluster.worker_messages import SpecStats, WorkerStats, stats_to_wire

_PEER = b"peer-metadata"
MAX_METADATA_BYTES = 1 << 20


def _node_address() -> str:
    """This node's address as Ray knows it (a multi-node cluster: the KV listener binds it)."""
    import ray  # noqa: PLC0415 - Ray reads its settings at import: the driver imports this module before it sets them
    return ray.util.get_node_ip_address()


def _own_disk_tier(engine: EngineConfig, name: str) -> EngineConfig:
    """Each worker's disk tier in its own folder under --kv-disk-dir, named by the worker: a
    restarted worker (same name) finds its files again, and no two writers share an index."""
    cache = engine.cache
    if cache.kv_disk_dir is None:
        return engine
    return dataclasses.replace(engine, cache=dataclasses.replace(cache, kv_disk_dir=str(Path(cache.kv_disk_dir) / name)))


def _kv_event_log(name: str, shared: str | None) -> KVEventLog:
    """The log of what this worker's pool and tiers gain and lose, read by the router's index. A
    node-shared host tier is one domain per node and segment: every worker of it reports into it."""
    return KVEventLog(name, host_domain=f"{socket.gethostname()}/{shared}" if shared else name)


def _end_process() -> None:
    """A tensor-parallel worker whose group broke ends its process: Ray restarts the actor, the
    router fails its requests over as for any dead worker."""
    os._exit(1)


class SigtermDrain:
    """SIGTERM (Kubernetes deleting a pod, an operator) is a drain, not a crash: the worker's stats
    say `leaving`, the driver moves its sequences to peers and removes it (cluster/launch/admin.py),
    and the process exits by itself once `grace_s` (--drain-timeout) has passed, whatever the driver
    did. Python handles signals on a process's main thread only, where an actor's code never runs:
    the wiring installs it as Ray's worker process setup hook (`install_sigterm_drain`)."""

    def __init__(self):
        self.leaving = threading.Event()
        self.grace_s = 30.0
        self.idle: Callable[[], bool] = lambda: True    # nothing to hand over (the worker's own check)

    def on_sigterm(self, *_) -> None:
        if not self.leaving.is_set():
            self.leaving.set()
            threading.Thread(target=self._exit_when_done, daemon=True).start()

    def _exit_when_done(self) -> None:
        """Exit once drained (nothing running, queued or leased: what moved has been pulled), or at
        the grace's end. A worker idle when the signal comes (a node shutting down) exits at once."""
        limit = time.monotonic() + self.grace_s
        time.sleep(0.5)        # the driver reads `leaving` and stops routing here first
        while time.monotonic() < limit and not self.idle():
            time.sleep(0.1)
        os._exit(0)


SIGTERM_DRAIN = SigtermDrain()


def install_sigterm_drain() -> None:
    """Ray's `worker_process_setup_hook` (on the worker's main thread, before its task loop). Ray's
    loop then sets its own SIGTERM handler (exit at once) through `set_sigterm_handler`, which
    this replaces: the drain's handler is the one installed. Without that function (another Ray),
    Ray's own handling stays and a SIGTERM is a worker's death (its requests fail over)."""
    ray_utils = sys.modules.get("ray._private.utils")      # loaded: this runs inside Ray's worker
    signal.signal(signal.SIGTERM, SIGTERM_DRAIN.on_sigterm)
    if ray_utils is not None and hasattr(ray_utils, "set_sigterm_handler"):
        ray_utils.set_sigterm_handler = lambda _ray_handler: signal.signal(signal.SIGTERM, SIGTERM_DRAIN.on_sigterm)


class EngineWorker:
    role = "worker"

    def __init__(self, name: str, config: WorkerConfig, speculator_factory: SpeculatorFactory | None = None,
                 hold_factory: HoldFactory | None = None):
        """`speculator_factory`: the engine's speculation (given by the wiring, cluster/launch/app.py);
        `hold_factory`: the role's hold hook (a prefill worker's side of the handoff)."""
        self.name = name
        self.config = config
        self.kv_log = _kv_event_log(name, config.engine.cache.kv_host_shared)
        self.engine = LLMEngine(_own_disk_tier(config.engine, name), speculator_factory=speculator_factory,
                                hold_factory=hold_factory, kv_events=self.kv_log)
        self.progress: KVProgress | None = None    # the role's KV progress thread (set by the role)
        self.sealer = Sealer(config.cluster_secret.value) if config.cluster_secret is not None else None
        options = {}
        if config.transport in ("tcp", "cuda_ipc", "ucx"):    # the transports that listen themselves
            options = {"host": config.kv_host or _node_address(), "sealer": self.sealer}
        self.transport = make_transport(config.transport, name, **options)
        self.transport.register(self.engine.transfer_arena, self.engine.transfer_layout)
        self.mailbox = Mailbox(self.transport, sealer=self.sealer)
        self.peer_blocks: dict[str, int] = {}    # peer agent -> blocks in its arena (handles are checked)
        self.incarnation = uuid.uuid4().hex      # a restarted actor is a new incarnation
        self.ready = False                       # set by the driver once handshaken with its peers
        self._peer_metadata: dict[str, bytes] = {}
        self.weights_loaded = True               # --max-loaded-models: released and loaded on demand
        self.model_loads = 0
        SIGTERM_DRAIN.grace_s = config.drain_timeout_s
        SIGTERM_DRAIN.idle = self._drained

    def _start_loop(self, on_deltas: Callable[[list[TokenDelta]], None] | None = None) -> None:
        """The engine's thread; `on_deltas`: the role's observer of each step's deltas."""
        self.loop = EngineLoop(self.engine, sender=TokenSender(self.name), on_deltas=on_deltas,
                               stream_interval=self.config.stream_interval, stats_frame=self._stats_frame,
                               on_broken=_end_process)

    def kv_events(self, epoch: str, cursor: int) -> KVEventBatch:
        """What this worker's pool and tiers gained and lost since the router's `cursor` (or a
        snapshot): the router's cluster-wide KV index reads it (router/kv_index.py)."""
        return self.kv_log.read(epoch, cursor)

    def _stats_frame(self) -> bytes:
        """`stats` as a token-stream frame (the engine loop pushes it to the frontends)."""
        return encode_stats(stats_to_wire(self.stats()))

    def metadata(self) -> bytes:
        """This worker's transport metadata, sealed with the cluster secret (NIXL's agent metadata
        and the TCP address reach only peers that hold it)."""
        data = self.transport.metadata()
        return self.sealer.seal(_PEER, data) if self.sealer is not None else data

    async def add_peer(self, metadata: bytes) -> str:
        """Connect a peer. The same metadata again is a no-op: re-adding would drop a peer whose
        pulls may be in flight. New metadata under a known name is a restarted peer: replaced.
        Metadata that is not sealed with the cluster secret is refused before it is decoded."""
        sealed = metadata
        if self.sealer is not None:
            metadata = self.sealer.open(_PEER, sealed, MAX_METADATA_BYTES, replay=False)
            if metadata is None:
                raise TransferError("peer metadata not sealed with this cluster's secret: refused")
        peer = PeerMetadata.decode(metadata)
        if self._peer_metadata.get(peer.name) == metadata:
            return peer.name
        added = await self.loop.acall(lambda e: self.transport.add_peer(metadata))
        self._peer_metadata[peer.name] = metadata
        self.peer_blocks[peer.name] = peer.num_blocks
        return added

    def set_ready(self, incarnation: str) -> bool:
        """The driver has handshaken this incarnation with every peer: it may take work."""
        if incarnation == self.incarnation:
            self.ready = True
        return self.ready

    def stats(self) -> WorkerStats:
        pool, sched = self.engine.pool, self.engine.scheduler
        waiting, running = len(sched.waiting), len(sched.running)
        spec = self.engine.speculator.stats()
        heads = self.engine.speculator.heads    # --spec-online's head versions, or None
        return WorkerStats(
            name=self.name, role=self.role, incarnation=self.incarnation, ready=self.ready, pid=os.getpid(),
            steps=self.loop.steps, has_work=bool(waiting or running), blocks_used=pool.num_used,
            blocks_free=pool.num_free, blocks_total=pool.num_blocks, block_size=self.engine.layout.block_size,
            kv_bytes=self.engine.memory_plan.kv_bytes, kv_limit=self.engine.memory_plan.limit,
            waiting=waiting, running=running, prefix_queries=pool.queries, prefix_hits=pool.hits,
            prompt_tokens_computed=self.engine.prompt_tokens_computed,
            prompt_seconds=self.engine.prompt_seconds,
            kv_refused=self.mailbox.refused + self.transport.refused,
            kv_discarded=self.engine.kv_discarded, queue_seconds=sched.queue_seconds,
            queue_count=sched.queue_count, queue_time_buckets=sched.queue_time_buckets(),
            preemptions=sched.num_preemptions, spec=tuple(SpecStats(m, **c) for m, c in spec.items()),
            spec_heads=heads.versions() if heads is not None else (),
            tiers=self.engine.tiers.stats() if self.engine.tiers is not None else None,
            expert_tokens=expert_token_counts(self.engine.model),
            expert_rank_tokens=rank_token_counts(self.engine.model),
            expert_rebalances=self.engine.runner.balancer.rebalances if self.engine.runner.balancer else 0,
            taken_at=time.monotonic(), leaving=SIGTERM_DRAIN.leaving.is_set(),
            weights_loaded=self.weights_loaded, model_loads=self.model_loads,
            **self._role_stats())

    async def unload_weights(self) -> int:
        """Release the model's weights and its prefix cache (--max-loaded-models), between two steps;
        refused while a request runs or waits here. The bytes released (0: already released)."""
        def release(e: LLMEngine) -> int:
            if e.scheduler.waiting or e.scheduler.running:
                raise RequestError(f"worker {self.name} has requests: its weights stay loaded")
            if not self.weights_loaded:
                return 0
            e.pool.reset_prefix_cache()
            self.weights_loaded = False
            return release_weights(e.model)
        return await self.loop.acall(release)

    async def load_weights(self) -> bool:
        """Load the released weights again; False if they were loaded."""
        def load(e: LLMEngine) -> bool:
            if self.weights_loaded:
                return False
            restore_weights(e)
            self.weights_loaded = True
            self.model_loads += 1
            return True
        return await self.loop.acall(load)

    def _drained(self) -> bool:
        """Nothing left here for a SIGTERM's drain to wait for: no request, no lease."""
        stats = self.stats()
        return not (stats.has_work or stats.leases)

    def _role_stats(self) -> dict:
        """The role's part of `stats`: `prefill=PrefillStats(...)` or `handoff=HandoffStats(...)`."""
        return {}

    async def _compile(self, sampling) -> None:
        """A constrained request's grammar, compiled off the engine thread (a large schema takes
        milliseconds to seconds, and the step loop must not wait on it): the engine then finds it
        in its LRU. A constraint the library refuses is the request's fault."""
        if sampling.structured is None:
            return
        try:
            await asyncio.to_thread(self.engine.grammar.compiled, sampling.structured)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def _add_request(self, e: LLMEngine, *args, **kwargs) -> str:
        """`e.add_request`, with the engine's refusal (a bad prompt or option) typed as the
        request's own fault, so the router answers the client and keeps this worker in routing.
        A worker whose weights are released (--max-loaded-models) declines it as busy."""
        if not self.weights_loaded:
            raise WorkerBusy(f"worker {self.name}: its model's weights are not loaded")
        try:
            return e.add_request(*args, **kwargs)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def compute_setup(self):
        """The engine's kernel plan, threads and cores (cluster.placement.ComputeSetup)."""
        return self.engine.compute_setup()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.loop.close()
        self.transport.close()
