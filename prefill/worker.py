"""The prefill worker: computes a prompt's KV (chunked, prefix cache first), samples the first
token and publishes the blocks under a lease for a decode worker to pull.

A plain class; `cluster/launch/app.py` runs it as a Ray actor in its own process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.transfer.producer import KVProducer
from cluster.types import FinishReason, Fork, SamplingParams, TokenDelta, TokenLogprob
from cluster.worker_base import EngineWorker
from prefill.handoff import KVHold, publish_first

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
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # n > 1: the other samples' first tokens, drawn from the same prompt logits (finish_reason
    # None: it continues on the decode worker, on the same handle).
    forks: tuple[TokenDelta, ...] = ()

    @property
    def continues(self) -> list[str]:
        """Request ids (this one's and its forks') that a decode worker must continue."""
        return [d.request_id for d in (self, *self.forks) if d.finish_reason is None]


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, name: str, config: WorkerConfig):
        super().__init__(name, config)
        self.hold = KVHold(self.engine)
        self.producer = KVProducer(self.transport, self.engine.layout, self.engine.kv_cache.arena,
                                   self.hold.release, lease_seconds=config.lease_seconds,
                                   checksums=config.checksums, mailbox=self.mailbox)
        self._start_loop([self._poll_producer])

    def _poll_producer(self) -> float | None:
        self.producer.poll()
        return self.producer.poll_interval()

    async def prefill(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                      forks: tuple[tuple[str, SamplingParams], ...] = ()) -> PrefillResult:
        """`forks`: (request id, sampling) of more samples of this prompt: computed once, each
        with its own first token, all continued from one handle."""
        first_only = [Fork(rid, replace(sp, max_tokens=1)) for rid, sp in forks]

        def publish(e: LLMEngine, last: TokenDelta) -> PrefillResult:
            return self._publish(e, request_id, prompt_ids, sampling, last, dict(forks))
        return await self.loop.run(
            request_id, lambda e: self._add_request(e, prompt_ids, replace(sampling, max_tokens=1), request_id,
                                                    hold_kv=True, forks=first_only),
            on_end=publish)

    def _publish(self, e: LLMEngine, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 last: TokenDelta, forks: dict[str, SamplingParams] | None = None) -> PrefillResult:
        """On the engine thread, in the turn that finished the prefill (prefill/handoff.py)."""
        first = publish_first(self.hold, self.producer, request_id, prompt_ids, sampling, last, forks or {})
        return PrefillResult(request_id, last.token_ids[0] if last.token_ids else -1, last.text, first.reason,
                             first.handle, last.num_prompt_tokens, last.num_cached_tokens, last.logprobs,
                             last.prompt_logprobs, first.forks)

    async def abort(self, request_id: str) -> None:
        def go(e: LLMEngine):
            e.abort(request_id)
            self.producer.abort(request_id)
        await self.loop.acall(go)

    def stats(self) -> dict:
        return {**super().stats(), "leases": self.producer.num_active()}
