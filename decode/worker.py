"""The decode worker: pulls a request's KV from a prefill worker, verifies it and joins the
sequence to its continuously batched decode; or, for short or fully cached prompts (and in
colocated mode), runs both phases itself.

Deltas leave once per engine step for the frontend that owns each request (`SinkAddress` and
`key` come with the call); the call itself returns when the request has ended, so the frontend
learns of a dead worker from Ray.

If the handoff fails (a dead producer, a bad checksum, no free blocks), the worker recomputes the
prompt itself: a failed peer costs latency, never the request or a token already streamed.
A plain class; `cluster/app.py` runs it as a Ray actor in its own process.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.kv.block_pool import NoFreeBlocks
from cluster.token_stream import SinkAddress
from cluster.transfer.consumer import KVConsumer, KVPull, PullState
from cluster.types import FinishReason, KVHandle, SamplingParams, TokenDelta
from cluster.worker_base import EngineWorker
from decode.spec.speculator import make_speculator

log = logging.getLogger(__name__)


@dataclass
class _Handoff:
    """A request whose KV is being pulled; it joins the engine when the pull ends."""
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    handle: KVHandle
    aborted: bool = False
    times: dict = field(default_factory=dict)   # phase -> time.time(), for `handoff_timings`


PHASES = ("sent", "called", "pull_started", "read", "verified", "acked", "first_step")


@dataclass(frozen=True)
class HandoffTiming:
    """Where one handoff's time went, from the router's send of the handle to the first decode step
    that produced a token (wall-clock seconds between consecutive `PHASES`; one node's clock)."""
    request_id: str
    blocks: int
    call: float        # router sent the handle -> the decode call runs here (Ray)
    queue: float       # -> the engine thread takes it (waits for the step in progress)
    read: float        # -> the transport's read has landed
    verify: float      # -> checksums verified
    confirm: float     # -> the producer's ACK arrived (it released its pins)
    join: float        # -> the first decode step that includes the request has ended


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, name: str, config: WorkerConfig):
        super().__init__(name, config, speculator_factory=make_speculator)
        self.consumer = KVConsumer(self.transport, self.engine.layout, self.engine.kv_cache.arena,
                                   timeout_s=config.transfer_timeout_s, verify=config.checksums,
                                   mailbox=self.mailbox)
        self._handoffs: dict[str, _Handoff] = {}          # lease id -> handoff (engine thread only)
        self.handoffs = {"done": 0, "failed": 0, "bytes": 0, "seconds": 0.0}
        self.timings: deque[HandoffTiming] = deque(maxlen=1000)
        self._start_loop([self._poll_consumer])

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       sink: SinkAddress, key: int) -> str:
        """Both phases here (colocated mode, or a prompt not worth a handoff)."""
        last = await self.loop.run(request_id, lambda e: e.add_request(prompt_ids, sampling, request_id), sink, key)
        return last.finish_reason.value

    async def decode(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     handle_bytes: bytes, sink: SinkAddress, key: int, sent_at: float = 0.0) -> str:
        """Continue a request prefilled elsewhere; streams deltas from its second token on."""
        handle = KVHandle.decode(handle_bytes)
        done = asyncio.get_running_loop().create_future()
        times = {"sent": sent_at or time.time(), "called": time.time()}

        def begin(e: LLMEngine):
            self.loop.register(request_id, done, sink, key)
            times["pull_started"] = time.time()
            h = _Handoff(request_id, list(prompt_ids), sampling, handle, times=times)
            try:
                blocks = e.pool.allocate(len(handle.block_ids))
            except NoFreeBlocks:
                self._recompute(e, h, "no free blocks")
                return
            try:
                pull = self.consumer.start_pull(handle, blocks)
            except Exception:
                e.pool.free(reversed(blocks))
                self.loop.forget(request_id)
                raise
            self._handoffs[pull.lease_id] = h
        try:
            await self.loop.acall(begin)
        except asyncio.CancelledError:     # `begin` may still run: abort whatever it started
            self.loop.call(lambda e: self._abort(e, request_id))
            raise
        last = await self.loop.wait(request_id, done, abort=lambda e: self._abort(e, request_id))
        return last.finish_reason.value

    # --- engine thread ----------------------------------------------------------------------------
    def _poll_consumer(self) -> float | None:
        for pull in self.consumer.poll():
            h = self._handoffs.pop(pull.lease_id, None)
            if h is not None:
                self._pull_ended(self.engine, pull, h)
        return self.consumer.poll_interval()

    def _pull_ended(self, e: LLMEngine, pull: KVPull, h: _Handoff) -> None:
        """Join the batch in the same turn the pull ends: no hop back through asyncio."""
        if h.aborted:
            e.pool.free(reversed(pull.local_blocks))
            self.loop.emit([TokenDelta(h.request_id, (), "", FinishReason.ABORT, (), len(h.prompt_ids), 1, 0)])
            return
        if pull.state is PullState.DONE:
            t = pull.timings
            self.handoffs["done"] += 1
            self.handoffs["bytes"] += len(h.handle.block_ids) * e.layout.bytes_per_block()
            self.handoffs["seconds"] += t.get("acked", t["start"]) - t["start"]
            try:
                e.add_prefilled(h.request_id, h.prompt_ids, h.handle.first_token, h.sampling, pull.local_blocks,
                                h.handle.feature)
            except Exception as exc:  # noqa: BLE001 - the request's own fault: it ends here
                e.pool.free(reversed(pull.local_blocks))
                self.loop.fail(h.request_id, exc)
                return
            # pull.timings are perf_counter stamps: carry them onto the wall clock from "pull_started".
            base = h.times["pull_started"] - t["start"]
            for phase in ("read", "verified", "acked"):
                h.times[phase] = base + t.get(phase, t.get("read", t["start"]))
            self.loop.on_first_delta[h.request_id] = lambda: self._timed(h)
            return
        e.pool.free(reversed(pull.local_blocks))
        self._recompute(e, h, pull.error)

    def _timed(self, h: _Handoff) -> None:
        h.times["first_step"] = time.time()
        gaps = [max(0.0, h.times[b] - h.times[a]) for a, b in zip(PHASES, PHASES[1:])]
        self.timings.append(HandoffTiming(h.request_id, len(h.handle.block_ids), *gaps))

    def handoff_timings(self) -> list[dict]:
        """The last handoffs' phase times (bench/handoff_served.py reads them)."""
        return [asdict(t) for t in self.timings]

    def _recompute(self, e: LLMEngine, h: _Handoff, why: str) -> None:
        self.handoffs["failed"] += 1
        log.warning("handoff of %s failed (%s); recomputing here", h.request_id, why)
        rest = replace(h.sampling, max_tokens=h.sampling.max_tokens - 1)
        try:
            e.add_request([*h.prompt_ids, h.handle.first_token], rest, h.request_id)
        except Exception as exc:  # noqa: BLE001
            self.loop.fail(h.request_id, exc)

    def _abort(self, e: LLMEngine, request_id: str) -> None:
        for lease_id, h in self._handoffs.items():
            if h.request_id == request_id and not h.aborted:
                h.aborted = True               # the pull ends FAILED once nothing can land in our blocks
                self.consumer.abort(lease_id)
                return
        e.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await self.loop.acall(lambda e: self._abort(e, request_id))

    def stats(self) -> dict:
        return {**super().stats(), **{f"handoff_{k}": v for k, v in self.handoffs.items()}}
