"""The decode worker: pulls a request's KV from a prefill worker, verifies it and joins the
sequence to its continuously batched decode; or, for short or fully cached prompts (and in
colocated mode), runs both phases itself.

If the handoff fails (a dead producer, a bad checksum, no free blocks), the worker recomputes the
prompt itself: a failed peer costs latency, never the request or a token already streamed.
A plain class; `cluster/app.py` runs it as a Ray actor in its own process.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.kv.block_pool import NoFreeBlocks
from cluster.transfer.consumer import KVConsumer, PullState
from cluster.types import KVHandle, SamplingParams, TokenDelta
from cluster.worker_base import EngineWorker
from decode.spec.speculator import make_speculator

log = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, name: str, config: WorkerConfig):
        super().__init__(name, config, speculator_factory=make_speculator)
        self.consumer = KVConsumer(self.transport, self.engine.layout, self.engine.kv_cache.arena,
                                   timeout_s=config.transfer_timeout_s, verify=config.checksums,
                                   mailbox=self.mailbox)
        self._start_loop([self.consumer.poll])
        self.handoffs = {"done": 0, "failed": 0, "bytes": 0, "seconds": 0.0}

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams
                       ) -> AsyncIterator[TokenDelta]:
        """Both phases here (colocated mode, or a prompt not worth a handoff)."""
        async for delta in self.loop.stream(request_id, lambda e: e.add_request(prompt_ids, sampling, request_id)):
            yield delta

    async def decode(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     handle_bytes: bytes) -> AsyncIterator[TokenDelta]:
        """Continue a request prefilled elsewhere; yields deltas from its second token on."""
        handle = KVHandle.decode(handle_bytes)

        def start_pull(e: LLMEngine):
            try:
                blocks = e.pool.allocate(len(handle.block_ids))
            except NoFreeBlocks:
                return None
            try:
                return self.consumer.start_pull(handle, blocks)
            except Exception:
                e.pool.free(reversed(blocks))
                raise
        pull = await self.loop.acall(start_pull)
        try:
            while pull is not None and not pull.finished:
                await asyncio.sleep(0.0005)
        except asyncio.CancelledError:   # the client went away mid-handoff: release both sides
            def cancel(e: LLMEngine):
                self.consumer.abort(pull.lease_id)
                e.pool.free(reversed(pull.local_blocks))
            await asyncio.shield(self.loop.acall(cancel))
            raise
        first = handle.first_token
        if pull is not None and pull.state is PullState.DONE:
            self.handoffs["done"] += 1
            self.handoffs["bytes"] += len(handle.block_ids) * self.engine.layout.bytes_per_block()
            t = pull.timings
            self.handoffs["seconds"] += t.get("acked", t["start"]) - t["start"]
            start = lambda e: e.add_prefilled(request_id, prompt_ids, first, sampling, pull.local_blocks,  # noqa: E731
                                              handle.feature)
        else:
            self.handoffs["failed"] += 1
            if pull is not None:
                await self.loop.acall(lambda e: e.pool.free(reversed(pull.local_blocks)))
            log.warning("handoff of %s failed (%s); recomputing here", request_id,
                        pull.error if pull else "no free blocks")
            rest = replace(sampling, max_tokens=sampling.max_tokens - 1)
            start = lambda e: e.add_request([*prompt_ids, first], rest, request_id)  # noqa: E731
        async for delta in self.loop.stream(request_id, start):
            yield delta

    async def abort(self, request_id: str) -> None:
        await self.loop.acall(lambda e: e.abort(request_id))

    def stats(self) -> dict:
        return {**super().stats(), **{f"handoff_{k}": v for k, v in self.handoffs.items()}}
