"""The prefill worker: computes a prompt's KV (chunked, prefix cache first), samples the first
token and publishes the blocks under a lease for a decode worker to pull.

A plain class; `cluster/launch/app.py` runs it as a Ray actor in its own process.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.errors import WorkerBusy
from cluster.transfer.producer import KVProducer
from cluster.types import FinishReason, Fork, SamplingParams, TokenDelta
from cluster.worker_base import EngineWorker
from cluster.worker_messages import PrefillCall, PrefillResult, PrefillStats

log = logging.getLogger(__name__)


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

    async def prefill(self, call: PrefillCall) -> PrefillResult:
        """The prompt's KV and first token (and each fork's first token, from the same logits),
        published under one handle for a decode worker to continue."""
        first_only = [Fork(f.request_id, replace(f.sampling, max_tokens=1)) for f in call.forks]
        forks = {f.request_id: f.sampling for f in call.forks}
        prompt_ids = list(call.prompt_ids)

        def publish(e: LLMEngine, last: TokenDelta) -> PrefillResult:
            return self._publish(e, call.request_id, prompt_ids, call.sampling, last, forks)
        return await self.loop.run(
            call.request_id, lambda e: self._add_request(e, prompt_ids, replace(call.sampling, max_tokens=1),
                                                         call.request_id, hold_kv=True, forks=first_only),
            on_end=publish)

    @staticmethod
    def _first_reason(e: LLMEngine, last: TokenDelta, sampling: SamplingParams) -> FinishReason | None:
        """Why a request ends with its first token (None: a decode worker continues it)."""
        if last.finish_reason in (FinishReason.STOP, FinishReason.ABORT):
            return last.finish_reason
        if sampling.max_tokens == 1 or last.num_prompt_tokens + 1 >= e.max_model_len:
            return FinishReason.LENGTH
        return None

    def _publish(self, e: LLMEngine, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 last: TokenDelta, forks: dict[str, SamplingParams] | None = None) -> PrefillResult:
        """On the engine thread, in the turn that finished the prefill: the lease starts and the
        handle leaves at once, not a step later."""
        forks = forks or {}
        firsts = tuple(replace(d, finish_reason=self._first_reason(e, d, forks[d.request_id]))
                       for d in e.take_fork_firsts(request_id))
        if not last.token_ids and last.finish_reason is not FinishReason.ABORT:
            # Ended for lack of blocks before its first token: nothing to hand off, nothing kept.
            if request_id in e.scheduler.held:
                e.release_held_kv(request_id)
            need = -(-len(prompt_ids) // e.layout.block_size)
            raise WorkerBusy(f"prefill of {request_id} ended without a first token: its prompt needs {need} KV "
                             f"blocks and this worker has {e.pool.num_blocks} in the pool "
                             f"({e.pool.num_free} free); try another worker")
        reason = self._first_reason(e, last, sampling)
        handle = None
        if request_id in e.scheduler.held:
            if reason is not None and all(d.finish_reason is not None for d in firsts):
                e.release_held_kv(request_id)
            else:
                blocks, n = e.take_held_kv(request_id)
                h = self.producer.publish(request_id, blocks, n, last.token_ids[0])
                handle = replace(h, feature=e.take_held_feature(request_id)).encode()
        return PrefillResult(request_id, last.token_ids[0] if last.token_ids else -1, last.text, reason, handle,
                             last.num_prompt_tokens, last.num_cached_tokens, last.logprobs, last.prompt_logprobs,
                             firsts)

    async def abort(self, request_id: str) -> None:
        def go(e: LLMEngine):
            e.abort(request_id)
            self.producer.abort(request_id)
        await self.loop.acall(go)

    def _role_stats(self) -> dict:
        return {"prefill": PrefillStats(leases=self.producer.num_active())}
