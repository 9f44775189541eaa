"""What a prefill and a decode worker share: an engine on its own thread, a registered transport,
the transport handshake, the token streams to the frontends, and the stats the router polls (KV
usage, queues, prefix cache)."""
from __future__ import annotations

import os

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.engine_loop import EngineLoop, Poller
from cluster.token_stream import TokenSender
from cluster.transfer.messages import Mailbox
from cluster.transfer.registry import make_transport


class EngineWorker:
    role = "worker"

    def __init__(self, name: str, config: WorkerConfig, speculator_factory=None):
        self.name = name
        self.config = config
        self.engine = LLMEngine(config.engine, speculator_factory=speculator_factory)
        self.transport = make_transport(config.transport, name)
        self.transport.register(self.engine.kv_cache.arena, self.engine.layout)
        self.mailbox = Mailbox(self.transport)

    def _start_loop(self, pollers: list[Poller]) -> None:
        self.loop = EngineLoop(self.engine, pollers=pollers, sender=TokenSender(self.name),
                               stream_interval=self.config.stream_interval)

    def metadata(self) -> bytes:
        return self.transport.metadata()

    async def add_peer(self, metadata: bytes) -> str:
        return await self.loop.acall(lambda e: self.transport.add_peer(metadata))

    def stats(self) -> dict:
        pool, sched = self.engine.pool, self.engine.scheduler
        return {"name": self.name, "role": self.role, "pid": os.getpid(), "blocks_used": pool.num_used, "blocks_total": pool.num_blocks,
                "blocks_free": pool.num_free, "waiting": len(sched.waiting), "running": len(sched.running),
                "prefix_queries": pool.queries, "prefix_hits": pool.hits, "queue_seconds": sched.queue_seconds,
                "queue_count": sched.queue_count,
                "spec": self.engine.speculator.stats() if self.engine.speculator is not None else {}}

    def compute_setup(self):
        """The engine's kernel plan, threads and cores (cluster.placement.ComputeSetup)."""
        return self.engine.compute_setup()

    def close(self) -> None:
        self.loop.close()
        self.transport.close()
