"""The decode worker: pulls a request's KV from a prefill worker, verifies it and joins the
sequence to its continuously batched decode; or, for short or fully cached prompts (and in
colocated mode), runs both phases itself.

Deltas leave once per engine step for the frontend that owns each request (`SinkAddress` and
`key` come with the call); the call itself returns when the request has ended, so the frontend
learns of a dead worker from Ray.

If the handoff fails (a dead producer, a bad checksum), the worker recomputes the prompt itself: a
failed peer costs latency, never the request or a token already streamed. A handoff that finds no
free blocks is declined at once (the producer is told and releases its pins) with `WorkerBusy`: the
router then continues the request elsewhere or later, instead of recomputing it into a full pool.
Blocks taken for a pull belong to its `_Handoff` until the engine owns them, and are freed on
every path that does not get that far.
A plain class; `cluster/launch/app.py` runs it as a Ray actor in its own process.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.speculation import SpeculatorFactory
from cluster.errors import RequestError, WorkerBusy
from cluster.kv.block_pool import NoFreeBlocks
from cluster.transfer.consumer import KVConsumer, KVPull, PullState
from cluster.transfer.progress import KVProgress
from cluster.types import FinishReason, Fork, KVHandle, SamplingParams, TokenDelta
from cluster.worker_base import EngineWorker
from cluster.worker_messages import DecodeCall, GenerateCall, HandoffStats
from decode.handoff import add_prefilled
from decode.spec.online.messages import HeadUpdate, OnlineReport
from decode.spec.speculator import make_speculator

log = logging.getLogger(__name__)


@dataclass
class _Handoff:
    """A request whose KV is being pulled; it joins the engine when the pull ends."""
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    handle: KVHandle
    first_token: int
    forks: tuple[Fork, ...] = ()     # each with its first token
    tenant: str = ""
    aborted: bool = False
    times: dict = field(default_factory=dict)   # phase -> time.time(), for `handoff_timings`
    prefix_of: GenerateCall | None = None        # a prefix fetched for this call, which runs here once it lands

    @property
    def members(self) -> list[str]:
        return [self.request_id, *(f.request_id for f in self.forks)]


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

    def __init__(self, name: str, config: WorkerConfig, speculator_factory: SpeculatorFactory = make_speculator):
        super().__init__(name, config, speculator_factory=speculator_factory)
        self._handoffs: dict[str, _Handoff] = {}          # lease id -> handoff (engine thread only)
        self.handoffs = {"done": 0, "failed": 0, "declined": 0, "bytes": 0, "seconds": 0.0, "fetched": 0,
                         "fetched_blocks": 0, "fetch_failed": 0}
        self.timings: deque[HandoffTiming] = deque(maxlen=1000)
        self._start_loop()
        self.progress = KVProgress(self._poll_consumer, f"kv-{name}")
        self.consumer = KVConsumer(self.transport, self.engine.layout, self.engine.kv_cache.arena,
                                   timeout_s=config.transfer_timeout_s, verify=config.checksums,
                                   mailbox=self.mailbox, on_work=self.progress.wake)

    async def generate(self, call: GenerateCall) -> FinishReason:
        """Both phases here (colocated mode, or a prompt not worth a handoff). A failover's
        `resume_samples` resumes the seeded generator where the attempt before stopped instead of
        restarting from the seed; `forks` are computed on the prompt once. With a `prefix_handle`
        (router: PrefillPlace.FETCHED) the prompt's leading blocks are pulled from the worker that
        holds them and cached here first; a pull that fails only costs their computation."""
        await self._compile(call.sampling)
        handle = self._prefix_handle(call)

        def start(e: LLMEngine):
            if handle is None or not self._start_prefix_pull(e, call, handle):
                self._start_generate(e, call)
        last = await self.loop.run(call.request_id, start, call.sink, call.key, forks=call.forks, abort=self._abort)
        return last.finish_reason

    def _start_generate(self, e: LLMEngine, call: GenerateCall) -> None:
        self._add_request(e, list(call.prompt_ids), call.sampling, call.request_id,
                          forks=[Fork(f.request_id, f.sampling) for f in call.forks], tenant=call.tenant)
        if call.resume_samples:
            e.skip_samples(call.request_id, call.resume_samples)

    def _prefix_handle(self, call: GenerateCall) -> KVHandle | None:
        if call.prefix_handle is None:
            return None
        try:
            handle = KVHandle.decode(call.prefix_handle)
        except ValueError as exc:
            log.warning("prefix handle for %s refused (%s); computing the prompt", call.request_id, exc)
            return None
        arena = self.peer_blocks.get(handle.producer)
        if arena is None or max(handle.block_ids) >= arena or handle.num_tokens > len(call.prompt_ids):
            self.consumer.decline(handle, "refused")
            return None
        return handle

    def _start_prefix_pull(self, e: LLMEngine, call: GenerateCall, handle: KVHandle) -> bool:
        """Pull the exported prefix into free blocks; False (declined: computed instead) without room."""
        try:
            blocks = e.pool.allocate(len(handle.block_ids))
        except NoFreeBlocks:
            self.consumer.decline(handle, "no free blocks")
            return False
        try:
            pull = self.consumer.start_pull(handle, blocks)
        except Exception:  # noqa: BLE001 - a prefix we cannot read is computed, never the request's loss
            e.pool.free(reversed(blocks))
            self.consumer.decline(handle, "refused")
            return False
        self._handoffs[pull.lease_id] = _Handoff(call.request_id, list(call.prompt_ids), call.sampling, handle, -1,
                                                 tuple(Fork(f.request_id, f.sampling) for f in call.forks),
                                                 tenant=call.tenant, prefix_of=call)
        return True

    def _prefix_landed(self, e: LLMEngine, pull: KVPull, h: _Handoff) -> None:
        """A fetched prefix's pull ended: its blocks join this pool's prefix cache (checked by the
        transport's checksums), then the request starts here and finds them as prefix hits."""
        if pull.state is PullState.DONE:
            bs = e.layout.block_size
            n = h.handle.num_tokens // bs
            keys = e.prefix_keys(h.prompt_ids[:n * bs], h.sampling.cache_salt)
            for block, key in zip(pull.local_blocks, keys):
                e.pool.cache_block(block, key)
            self.handoffs["fetched"] += 1
            self.handoffs["fetched_blocks"] += n
            self.handoffs["bytes"] += len(h.handle.block_ids) * e.layout.bytes_per_block()
            self.handoffs["seconds"] += pull.timings.get("acked", pull.timings["start"]) - pull.timings["start"]
        else:
            self.handoffs["fetch_failed"] += 1
            log.warning("prefix fetch for %s failed (%s); computing the prompt", h.request_id, pull.error)
        e.pool.free(reversed(pull.local_blocks))
        try:
            self._start_generate(e, h.prefix_of)
        except Exception as exc:  # noqa: BLE001 - the request's own fault (a bad option): it ends here
            for rid in h.members:
                self.loop.fail(rid, exc)

    async def decode(self, call: DecodeCall) -> FinishReason:
        """Continue a request prefilled elsewhere; streams deltas from its second token on (its
        forks' too, on the same pulled blocks). Aborting any of them during the pull aborts all."""
        try:
            handle = KVHandle.decode(call.handle)
        except ValueError as exc:
            raise RequestError(f"decode worker {self.name} refused the KV handle: {exc}") from None
        arena = self.peer_blocks.get(handle.producer)
        if arena is None or max(handle.block_ids) >= arena:
            raise RequestError(f"decode worker {self.name} refused the KV handle: its blocks are not inside a "
                               f"known producer's arena ({handle.producer!r})")
        await self._compile(call.sampling)
        times = {"sent": call.sent_at or time.time(), "called": time.time()}

        def begin(e: LLMEngine):
            times["pull_started"] = time.time()
            h = _Handoff(call.request_id, list(call.prompt_ids), call.sampling, handle,
                         handle.first_token if call.first_token is None else call.first_token,
                         tuple(Fork(f.request_id, f.sampling, f.first_token) for f in call.forks), tenant=call.tenant,
                         times=times)
            n = len(handle.block_ids)
            try:
                blocks = e.pool.allocate(n)
            except NoFreeBlocks:
                self.consumer.decline(handle, "no free blocks")
                self.handoffs["declined"] += 1
                raise WorkerBusy(f"decode worker {self.name} has no room for a {n}-block handoff "
                                 f"({e.pool.num_free} of {e.pool.num_blocks} blocks free)") from None
            try:
                pull = self.consumer.start_pull(handle, blocks)
            except Exception as exc:
                e.pool.free(reversed(blocks))
                self.consumer.decline(handle, "refused")
                if isinstance(exc, ValueError):     # a layout mismatch or a malformed handle
                    raise RequestError(f"decode worker {self.name} refused the KV handle: {exc}") from None
                raise
            self._handoffs[pull.lease_id] = h
        last = await self.loop.run(call.request_id, begin, call.sink, call.key, forks=call.forks, abort=self._abort)
        return last.finish_reason

    # --- the KV progress thread, then the engine thread ----------------------------------------------
    def _poll_consumer(self) -> float | None:
        """On the KV progress thread: reads land and are confirmed while a step runs; a finished
        pull joins the batch (or is recomputed) on the engine thread, as the next command."""
        for pull in self.consumer.poll():
            self.loop.soon(lambda e, p=pull: self._pull_finished(e, p))
        return self.consumer.poll_interval()

    def _pull_finished(self, e: LLMEngine, pull: KVPull) -> None:
        h = self._handoffs.pop(pull.lease_id, None)
        if h is not None:
            self._pull_ended(e, pull, h)

    def _pull_ended(self, e: LLMEngine, pull: KVPull, h: _Handoff) -> None:
        """Join the batch in the same turn the pull ends: no hop back through asyncio. Until
        `add_prefilled` (decode/handoff.py) has taken the blocks they are this function's to free, on every path."""
        if h.prefix_of is not None and not h.aborted and self.loop.has_stream(h.request_id):
            self._prefix_landed(e, pull, h)
            return
        if h.aborted:
            e.pool.free(reversed(pull.local_blocks))
            self.loop.emit([TokenDelta(rid, (), "", FinishReason.ABORT, (), len(h.prompt_ids), 1, 0)
                            for rid in h.members])
            return
        if not any(self.loop.has_stream(rid) for rid in h.members):
            # Its stream ended meanwhile (its frontend vanished, or every stream failed): nobody
            # waits for this request, and a retry may already run elsewhere under its id.
            e.pool.free(reversed(pull.local_blocks))
            return
        if pull.state is PullState.DONE:
            joined = False
            try:
                t = pull.timings
                self.handoffs["done"] += 1
                self.handoffs["bytes"] += len(h.handle.block_ids) * e.layout.bytes_per_block()
                self.handoffs["seconds"] += t.get("acked", t["start"]) - t["start"]
                add_prefilled(e, h.request_id, h.prompt_ids, h.first_token, h.sampling, pull.local_blocks,
                              h.handle.feature, forks=h.forks, tenant=h.tenant)
                joined = True
                for rid in h.members:           # a member whose stream ended meanwhile runs for nobody
                    if not self.loop.has_stream(rid):
                        e.abort(rid)
            except Exception as exc:  # noqa: BLE001 - the request's own fault: it ends here
                for rid in h.members:
                    self.loop.fail(rid, RequestError(str(exc)) if isinstance(exc, ValueError) else exc)
                return
            finally:
                if not joined:
                    e.pool.free(reversed(pull.local_blocks))
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

    def handoff_timings(self) -> tuple[HandoffTiming, ...]:
        """The last handoffs' phase times (bench/handoff_served.py reads them)."""
        return tuple(self.timings)

    def _recompute(self, e: LLMEngine, h: _Handoff, why: str) -> None:
        """The pull failed (the producer died, a bad checksum): compute the prompt here. The
        first token was sampled by the producer, so the generator skips that draw."""
        self.handoffs["failed"] += 1
        log.warning("handoff of %s failed (%s); recomputing here", h.request_id, why)
        for rid, sampling, first in ((h.request_id, h.sampling, h.first_token),
                                     *((f.request_id, f.sampling, f.first_token) for f in h.forks)):
            rest = replace(sampling, max_tokens=sampling.max_tokens - 1, prompt_logprobs=None)
            try:
                e.add_request([*h.prompt_ids, first], rest, rid, tenant=h.tenant)
                e.skip_samples(rid, 1)
            except Exception as exc:  # noqa: BLE001
                self.loop.fail(rid, RequestError(str(exc)) if isinstance(exc, ValueError) else exc)

    def _abort(self, e: LLMEngine, request_id: str) -> None:
        for lease_id, h in self._handoffs.items():
            if request_id in h.members and not h.aborted:
                h.aborted = True               # the pull ends FAILED once nothing can land in our blocks
                self.consumer.abort(lease_id)
                return
        e.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await self.loop.acall(lambda e: self._abort(e, request_id))

    # --- online adaptation of the EAGLE head (decode/spec/online/service.py calls these) ---------------
    def _online(self):
        heads = getattr(self.engine.speculator, "heads", None)
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
        return {"handoff": HandoffStats(**self.handoffs)}
