"""The prefill worker: computes a prompt's KV (chunked, prefix cache first), samples the first
token and publishes the blocks under a lease for a decode worker to pull.

A plain class; `cluster/app.py` runs it as a Ray actor in its own process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.errors import WorkerBusy
from cluster.transfer.producer import KVProducer
from cluster.types import FinishReason, SamplingParams, TokenDelta, TokenLogprob
from cluster.worker_base import EngineWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    text: str
    finish_reason: FinishReason | None     # set when the request ends with its first token
    handle: bytes | None                   # KVHandle (msgpack) when a decode worker must continue
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, name: str, config: WorkerConfig):
        super().__init__(name, config)
        self.producer = KVProducer(self.transport, self.engine.layout, self.engine.kv_cache.arena,
                                   self.engine.release_held_kv, lease_seconds=config.lease_seconds,
                                   checksums=config.checksums, mailbox=self.mailbox)
        self._start_loop([self._poll_producer])

    def _poll_producer(self) -> float | None:
        self.producer.poll()
        return self.producer.poll_interval()

    async def prefill(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> PrefillResult:
        first_only = replace(sampling, max_tokens=1)

        def publish(e: LLMEngine, last: TokenDelta) -> PrefillResult:
            return self._publish(e, request_id, prompt_ids, sampling, last)
        return await self.loop.run(
            request_id, lambda e: self._add_request(e, prompt_ids, first_only, request_id, hold_kv=True),
            on_end=publish)

    def _publish(self, e: LLMEngine, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 last: TokenDelta) -> PrefillResult:
        """On the engine thread, in the turn that finished the prefill: the lease starts and the
        handle leaves at once, not a step later."""
        if not last.token_ids and last.finish_reason is not FinishReason.ABORT:
            # Ended for lack of blocks before its first token: nothing to hand off, nothing kept.
            if request_id in e.scheduler.held:
                e.release_held_kv(request_id)
            need = -(-len(prompt_ids) // e.layout.block_size)
            raise WorkerBusy(f"prefill of {request_id} ended without a first token: its prompt needs {need} KV "
                             f"blocks and this worker has {e.pool.num_blocks} in the pool "
                             f"({e.pool.num_free} free); try another worker")
        if last.finish_reason in (FinishReason.STOP, FinishReason.ABORT):
            reason = last.finish_reason
        elif sampling.max_tokens == 1 or len(prompt_ids) + 1 >= e.max_model_len:
            reason = FinishReason.LENGTH
        else:
            reason = None
        handle = None
        if request_id in e.scheduler.held:
            if reason is not None:
                e.release_held_kv(request_id)
            else:
                blocks, n = e.take_held_kv(request_id)
                h = self.producer.publish(request_id, blocks, n, last.token_ids[0])
                handle = replace(h, feature=e.take_held_feature(request_id)).encode()
        return PrefillResult(request_id, last.token_ids[0] if last.token_ids else -1, last.text, reason, handle,
                             last.num_prompt_tokens, last.num_cached_tokens, last.logprobs)

    async def abort(self, request_id: str) -> None:
        def go(e: LLMEngine):
            e.abort(request_id)
            self.producer.abort(request_id)
        await self.loop.acall(go)

    def stats(self) -> dict:
        return {**super().stats(), "leases": self.producer.num_active()}
