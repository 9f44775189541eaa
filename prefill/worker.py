"""The prefill worker: computes a prompt's KV (chunked, prefix cache first), samples the first
token and publishes the blocks under a lease for a decode worker to pull.

A plain class; `cluster/launch/app.py` runs it as a Ray actor in its own process.
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
        self.producer = KVProducer(self.transport, self.engine.layout, self.engine.kv_cache.arena,
                                   self.engine.release_held_kv, lease_seconds=config.lease_seconds,
                                   checksums=config.checksums, mailbox=self.mailbox)
        self._start_loop([self._poll_producer])

    def _poll_producer(self) -> float | None:
        self.producer.poll()
        return self.producer.poll_interval()

    async def prefill(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                      forks: tuple[tuple[str, SamplingParams], ...] = ()) -> PrefillResult:
        """`forks`: (request id, sampling) of more samples of this prompt: computed once, each
        with its own first token, all continued from one handle."""
        first_only = [(rid, replace(sp, max_tokens=1)) for rid, sp in forks]

        def publish(e: LLMEngine, last: TokenDelta) -> PrefillResult:
            return self._publish(e, request_id, prompt_ids, sampling, last, dict(forks))
        return await self.loop.run(
            request_id, lambda e: self._add_request(e, prompt_ids, replace(sampling, max_tokens=1), request_id,
                                                    hold_kv=True, forks=first_only),
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

    def stats(self) -> dict:
        return {**super().stats(), "leases": self.producer.num_active()}
