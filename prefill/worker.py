"""The prefill worker: computes a prompt's KV (chunked, prefix cache first), samples the first
token and publishes the blocks under a lease for a decode worker to pull.

A plain class; `cluster/launch/app.py` runs it as a Ray actor in its own process, with a
speculator factory that never proposes (`decode.spec.speculator.make_kv_only_speculator`: with an
EAGLE head it computes the head's KV and the hidden state the handle carries). The factory comes
as an argument: this role does not import the decode role.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.speculation import SpeculatorFactory
from cluster.transfer.producer import KVProducer, LeaseState
from cluster.transfer.progress import KVProgress
from cluster.types import Fork, SamplingParams, TokenDelta
from cluster.worker_base import EngineWorker
from cluster.worker_messages import PrefillCall, PrefillResult, PrefillStats
from prefill.handoff import PrefillHandoff, publish_first

log = logging.getLogger(__name__)


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, name: str, config: WorkerConfig, speculator_factory: SpeculatorFactory | None = None):
        super().__init__(name, config, speculator_factory=speculator_factory, hold_factory=PrefillHandoff)
        self.hold: PrefillHandoff = self.engine.hold_hook
        self._start_loop()
        self.progress = KVProgress(self._poll_producer, f"kv-{name}")
        self.producer = KVProducer(self.transport, self.engine.layout, self.engine.kv_cache.arena,
                                   self._lease_ended, lease_seconds=config.lease_seconds,
                                   checksums=config.checksums, mailbox=self.mailbox, on_work=self.progress.wake)

    def _poll_producer(self) -> float | None:
        """On the KV progress thread: DONE is acknowledged and leases expire while a step runs."""
        self.producer.poll()
        return self.producer.poll_interval()

    def _lease_ended(self, request_id: str, state: LeaseState) -> None:
        """A lease ended: its blocks go back to the pool on the engine thread, which owns it."""
        self.loop.soon(lambda e: self.hold.lease_ended(request_id, state))

    async def prefill(self, call: PrefillCall) -> PrefillResult:
        """The prompt's KV and first token (and each fork's first token, from the same logits),
        published under one handle for a decode worker to continue."""
        await self._compile(call.sampling)
        first_only = [Fork(f.request_id, replace(f.sampling, max_tokens=1)) for f in call.forks]
        forks = {f.request_id: f.sampling for f in call.forks}
        prompt_ids = list(call.prompt_ids)

        def publish(e: LLMEngine, last: TokenDelta) -> PrefillResult:
            return self._publish(e, call.request_id, prompt_ids, call.sampling, last, forks, call.export)
        return await self.loop.run(
            call.request_id, lambda e: self._add_request(e, prompt_ids, replace(call.sampling, max_tokens=1),
                                                         call.request_id, hold_kv=True, forks=first_only),
            on_end=publish, stats_sink=call.stats_sink)

    def _publish(self, e: LLMEngine, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 last: TokenDelta, forks: dict[str, SamplingParams] | None = None,
                 export: bool = False) -> PrefillResult:
        """On the engine thread, in the turn that finished the prefill (prefill/handoff.py)."""
        first = publish_first(self.hold, self.producer, request_id, prompt_ids, sampling, last, forks or {}, export)
        delta = replace(last, token_ids=last.token_ids[:1], finish_reason=first.reason, num_output_tokens=1)
        return PrefillResult(request_id, delta, first.handle, first.forks)

    async def abort(self, request_id: str) -> None:
        def go(e: LLMEngine):
            e.abort(request_id)
            self.producer.abort(request_id)
        await self.loop.acall(go)

    def _role_stats(self) -> dict:
        return {"prefill": PrefillStats(leases=self.producer.num_active())}
