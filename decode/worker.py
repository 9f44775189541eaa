"""The decode worker: the entry points of a decode role. It continues requests prefilled elsewhere
(`decode`: the handoff itself is `handoff.py`'s `DecodeHandoff`), or, for short or fully cached
prompts (and in colocated mode), runs both phases itself (`generate`).

Deltas leave once per engine step for the frontend that owns each request (`SinkAddress` and
`key` come with the call); the call itself returns when the request has ended, so the frontend
learns of a dead worker from Ray. A failed handoff is recomputed here (a failed peer costs
latency, never the request); one that finds no free blocks is declined at once with `WorkerBusy`.
A plain class; `cluster/launch/app.py` runs it as a Ray actor in its own process.
"""
from __future__ import annotations

import asyncio
import time

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.speculation import SpeculatorFactory
from cluster.errors import RequestError
from cluster.transfer.consumer import KVConsumer
from cluster.transfer.progress import KVProgress
from cluster.types import FinishReason, Fork
from cluster.worker_base import EngineWorker
from cluster.worker_messages import DecodeCall, GenerateCall
from decode.handoff import DecodeHandoff, HandoffTiming
from decode.spec.online.messages import HeadUpdate, OnlineReport
from decode.spec.speculator import make_speculator


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, name: str, config: WorkerConfig, speculator_factory: SpeculatorFactory = make_speculator):
        super().__init__(name, config, speculator_factory=speculator_factory)
        self._start_loop(on_deltas=lambda deltas: self.handoff.observe(deltas))
        self.progress = KVProgress(lambda: self.handoff.poll(), f"kv-{name}")
        consumer = KVConsumer(self.transport, self.engine.transfer_layout, self.engine.transfer_arena,
                              timeout_s=config.transfer_timeout_s, verify=config.checksums,
                              mailbox=self.mailbox, on_work=self.progress.wake)
        self.handoff = DecodeHandoff(name, self.loop, consumer, self.peer_blocks, self._start_generate)

    async def generate(self, call: GenerateCall) -> FinishReason:
        """Both phases here (colocated mode, or a prompt not worth a handoff). A failover's
        `resume_samples` resumes the seeded generator where the attempt before stopped instead of
        restarting from the seed; `forks` are computed on the prompt once. With a `prefix_handle`
        (router: PrefillPlace.FETCHED) the prompt's leading blocks are pulled from the worker that
        holds them and cached here first; a pull that fails only costs their computation."""
        await self._compile(call.sampling)
        handle = self.handoff.prefix_handle(call)

        def start(e: LLMEngine):
            if handle is None or not self.handoff.start_prefix(e, call, handle):
                self._start_generate(e, call)
        last = await self.loop.run(call.request_id, start, call.sink, call.key, forks=call.forks,
                                   abort=self.handoff.abort)
        return last.finish_reason

    def _start_generate(self, e: LLMEngine, call: GenerateCall) -> None:
        self._add_request(e, list(call.prompt_ids), call.sampling, call.request_id,
                          forks=[Fork(f.request_id, f.sampling) for f in call.forks], tenant=call.tenant)
        if call.resume_samples:
            e.skip_samples(call.request_id, call.resume_samples)

    async def decode(self, call: DecodeCall) -> FinishReason:
        """Continue a request prefilled elsewhere; streams deltas from its second token on (its
        forks' too, on the same pulled blocks). Aborting any of them during the pull aborts all."""
        handle = self.handoff.open_handle(call)
        await self._compile(call.sampling)
        times = {"sent": call.sent_at or time.time(), "called": time.time()}
        last = await self.loop.run(call.request_id, lambda e: self.handoff.start_decode(e, call, handle, times),
                                   call.sink, call.key, forks=call.forks, abort=self.handoff.abort)
        return last.finish_reason

    def handoff_timings(self) -> tuple[HandoffTiming, ...]:
        """The last handoffs' phase times (bench/handoff_served.py reads them)."""
        return tuple(self.handoff.timings)

    async def abort(self, request_id: str) -> None:
        await self.loop.acall(lambda e: self.handoff.abort(e, request_id))

    # --- online adaptation of the EAGLE head (decode/spec/online/service.py calls these) ---------------
    def _online(self):
        heads = self.engine.speculator.heads
        if heads is None:
            raise RequestError(f"decode worker {self.name} does not adapt its EAGLE head (--spec-online is off)")
        return heads

    async def spec_online_take(self) -> OnlineReport:
        """The served samples and acceptance counts since the last take, and the live head versions."""
        heads = self._online()
        samples, counts = await self.loop.acall(lambda e: e.speculator.take_online())
        return OnlineReport(self.name, self.incarnation, samples, counts, heads.versions())

    async def spec_head_stage(self, update: HeadUpdate) -> None:
        """Check and build a head version (off the engine thread); `spec_head_activate` swaps to it."""
        heads = self._online()
        try:
            head = await asyncio.to_thread(heads.build_update, update)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        await self.loop.acall(lambda e: heads.stage(update, head))

    async def spec_head_activate(self, tenant: str, version: int, rollback: bool = False) -> None:
        """Between two steps, `version` (staged, or 0: the base head) becomes `tenant`'s head."""
        heads = self._online()
        await self.loop.acall(lambda e: heads.activate(tenant, version, rollback))

    def _role_stats(self) -> dict:
        return {"handoff": self.handoff.stats()}
