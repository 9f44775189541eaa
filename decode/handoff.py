"""The decode side of a P/D handoff: `DecodeHandoff`, the one owner of a decode worker's pulls, from
the handle to the batch.

A handle's blocks are asked of the scheduler (`Scheduler.reserve_external`, the pool's only
owner) and filled by a pull over cluster/transfer/consumer.py (read, verify checksums, confirm the
lease); when the pull ends the sequence joins the batch here (`add_prefilled`, with its forks on
the same blocks), in the same engine-thread turn. Until a sequence holds them, the blocks are the
pull's (`PendingPull`) and go back to the scheduler on every path that does not get that far.

If the pull fails (a dead producer, a bad checksum) the prompt is recomputed here (`_recompute`):
a failed peer costs latency, never the request or a token already streamed. A handle that finds no
free blocks is declined at once (the producer is told and releases its pins) with `WorkerBusy`.
A prefix fetched for a request this worker computes (router: PrefillPlace.FETCHED) lands in the
prefix cache instead (`_prefix_landed`). `HandoffCounters` and `HandoffTiming` are what the metrics
and bench/handoff_served.py read.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence as Seq
from dataclasses import asdict, dataclass, field, replace

from cluster.engine.engine import LLMEngine
from cluster.engine.engine_loop import EngineLoop
from cluster.engine.sequence import Sequence
from cluster.errors import RequestError, WorkerBusy
from cluster.kv.block_pool import NoFreeBlocks
from cluster.transfer.consumer import KVConsumer, KVPull, PullState
from cluster.types import FinishReason, Fork, KVHandle, SamplingParams, TokenDelta
from cluster.worker_messages import DecodeCall, GenerateCall, HandoffStats

log = logging.getLogger(__name__)


@dataclass
class HandoffCounters:
    """A decode worker's handoffs so far: pulled, failed (recomputed here), declined (no room), and
    prefixes fetched; `stats` is their frozen snapshot."""
    done: int = 0
    failed: int = 0
    declined: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fetched: int = 0
    fetched_blocks: int = 0
    fetch_failed: int = 0

    def stats(self) -> HandoffStats:
        return HandoffStats(**asdict(self))


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


@dataclass
class PendingPull:
    """A request whose KV is being pulled; it joins the engine when the pull ends."""
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    handle: KVHandle                 # every sample's first token is the handle's
    forks: tuple[Fork, ...] = ()
    tenant: str = ""
    aborted: bool = False
    times: dict = field(default_factory=dict)   # phase -> time.time(), for `HandoffTiming`
    prefix_of: GenerateCall | None = None        # a prefix fetched for this call, which runs here once it lands

    @property
    def members(self) -> list[str]:
        return [self.request_id, *(f.request_id for f in self.forks)]


class DecodeHandoff:
    """Pulls by lease id (engine thread only), the counters and the last handoffs' timings.
    `start_generate(engine, call)`: how the worker starts a request it computes (after a fetched
    prefix has landed); `peer_blocks`: each known producer's arena size, to check handles against."""

    def __init__(self, name: str, loop: EngineLoop, consumer: KVConsumer, peer_blocks: dict[str, int],
                 start_generate: Callable[[LLMEngine, GenerateCall], None]):
        self.name = name
        self.loop = loop
        self.consumer = consumer
        self.peer_blocks = peer_blocks
        self.start_generate = start_generate
        self.pending: dict[str, PendingPull] = {}
        self.joined: dict[str, PendingPull] = {}   # request id -> a joined handoff whose first step is to be timed
        self.counters = HandoffCounters()
        self.timings: deque[HandoffTiming] = deque(maxlen=1000)

    # --- a handle arrives (the decode worker's entry points) -------------------------------------
    def open_handle(self, call: DecodeCall) -> KVHandle:
        """A decode call's handle, checked: its fault (RequestError) when malformed, foreign, or
        without the first token of one of the call's forks (then declined: the pins go at once)."""
        try:
            handle = KVHandle.decode(call.handle)
        except ValueError as exc:
            raise RequestError(f"decode worker {self.name} refused the KV handle: {exc}") from None
        arena = self.peer_blocks.get(handle.producer)
        if arena is None or max(handle.block_ids) >= arena:
            raise RequestError(f"decode worker {self.name} refused the KV handle: its blocks are not inside a "
                               f"known producer's arena ({handle.producer!r})")
        # The lead may be a fork of the prefilled request (the request itself ended with its first token).
        firsts = handle.first_tokens()
        missing = [rid for rid in (call.request_id, *(f.request_id for f in call.forks)) if rid not in firsts]
        if missing:
            self.consumer.decline(handle, "refused")
            raise RequestError(f"decode worker {self.name} refused the KV handle: no first token for {missing}")
        return handle

    def start_decode(self, e: LLMEngine, call: DecodeCall, handle: KVHandle, times: dict) -> None:
        """On the engine thread: take blocks for the handle and start its pull, or decline."""
        times["pull_started"] = time.time()
        h = PendingPull(call.request_id, list(call.prompt_ids), call.sampling, handle,
                        tuple(Fork(f.request_id, f.sampling) for f in call.forks), tenant=call.tenant, times=times)
        n = len(handle.block_ids)
        try:
            blocks = e.scheduler.reserve_external(n)
        except NoFreeBlocks:
            self.consumer.decline(handle, "no free blocks")
            self.counters.declined += 1
            raise WorkerBusy(f"decode worker {self.name} has no room for a {n}-block handoff "
                             f"({e.pool.num_free} of {e.pool.num_blocks} blocks free)") from None
        try:
            pull = self.consumer.start_pull(handle, blocks)
        except Exception as exc:
            e.scheduler.release_external(blocks)
            self.consumer.decline(handle, "refused")
            if isinstance(exc, ValueError):     # a layout mismatch or a malformed handle
                raise RequestError(f"decode worker {self.name} refused the KV handle: {exc}") from None
            raise
        self.pending[pull.lease_id] = h

    def prefix_handle(self, call: GenerateCall) -> KVHandle | None:
        """A generate call's prefix handle, if usable (one that is not is declined: computed instead)."""
        if call.prefix_handle is None:
            return None
        try:
            handle = KVHandle.decode(call.prefix_handle)
        except ValueError as exc:
            log.warning("prefix handle for %s refused (%s); computing the prompt", call.request_id, exc)
            return None
        arena = self.peer_blocks.get(handle.producer)
        if arena is None or max(handle.block_ids) >= arena or handle.num_tokens > len(call.prompt_ids) \
                or handle.cache_offset:    # a compacted prompt is never an exact prefix
            self.consumer.decline(handle, "refused")
            return None
        return handle

    def start_prefix(self, e: LLMEngine, call: GenerateCall, handle: KVHandle) -> bool:
        """Pull the exported prefix into free blocks; False (declined: computed instead) without room."""
        try:
            blocks = e.scheduler.reserve_external(len(handle.block_ids))
        except NoFreeBlocks:
            self.consumer.decline(handle, "no free blocks")
            return False
        try:
            pull = self.consumer.start_pull(handle, blocks)
        except Exception:  # noqa: BLE001 - a prefix we cannot read is computed, never the request's loss
            e.scheduler.release_external(blocks)
            self.consumer.decline(handle, "refused")
            return False
        self.pending[pull.lease_id] = PendingPull(call.request_id, list(call.prompt_ids), call.sampling, handle,
                                                  tuple(Fork(f.request_id, f.sampling) for f in call.forks),
                                                  tenant=call.tenant, prefix_of=call)
        return True

    def abort(self, e: LLMEngine, request_id: str) -> None:
        """Abort a request: its pull, if one is in flight (it ends FAILED once nothing can land in
        our blocks), else the engine's."""
        for lease_id, h in self.pending.items():
            if request_id in h.members and not h.aborted:
                h.aborted = True
                self.consumer.abort(lease_id)
                return
        e.abort(request_id)

    def stats(self) -> HandoffStats:
        return self.counters.stats()

    # --- the KV progress thread, then the engine thread ----------------------------------------------
    def poll(self) -> float | None:
        """On the KV progress thread: reads land and are confirmed while a step runs; a finished
        pull joins the batch (or is recomputed) on the engine thread, as the next command."""
        for pull in self.consumer.poll():
            self.loop.soon(lambda e, p=pull: self._pull_finished(e, p))
        return self.consumer.poll_interval()

    def _pull_finished(self, e: LLMEngine, pull: KVPull) -> None:
        h = self.pending.pop(pull.lease_id, None)
        if h is not None:
            self._pull_ended(e, pull, h)

    def _pull_ended(self, e: LLMEngine, pull: KVPull, h: PendingPull) -> None:
        """Join the batch in the same turn the pull ends: no hop back through asyncio. Until
        `add_prefilled` has taken the blocks they are this function's to give back, on every path."""
        if h.prefix_of is not None and not h.aborted and self.loop.has_stream(h.request_id):
            self._prefix_landed(e, pull, h)
            return
        if h.aborted:
            e.scheduler.release_external(pull.local_blocks)
            self.loop.emit([TokenDelta(rid, (), "", FinishReason.ABORT, (), len(h.prompt_ids), 1, 0)
                            for rid in h.members])
            return
        if not any(self.loop.has_stream(rid) for rid in h.members):
            # Its stream ended meanwhile (its frontend vanished, or every stream failed): nobody
            # waits for this request, and a retry may already run elsewhere under its id.
            e.scheduler.release_external(pull.local_blocks)
            return
        if pull.state is not PullState.DONE:
            e.scheduler.release_external(pull.local_blocks)
            self._recompute(e, h, pull.error)
            return
        if self._join(e, pull, h):
            # pull.timings are perf_counter stamps: carry them onto the wall clock from "pull_started".
            t = pull.timings
            base = h.times["pull_started"] - t["start"]
            for phase in ("read", "verified", "acked"):
                h.times[phase] = base + t.get(phase, t.get("read", t["start"]))
            self.joined[h.request_id] = h

    def _join(self, e: LLMEngine, pull: KVPull, h: PendingPull) -> bool:
        """A pulled sequence (and its forks) joins the batch; False when it ended here instead."""
        joined = False
        try:
            t = pull.timings
            self.counters.done += 1
            self.counters.bytes += len(h.handle.block_ids) * e.transfer_layout.bytes_per_block()
            self.counters.seconds += t.get("acked", t["start"]) - t["start"]
            if e.kv_export is not None:   # a TP worker: the pulled blocks' heads to every rank
                e.kv_export.scatter(pull.local_blocks)
            firsts = h.handle.first_tokens()
            add_prefilled(e, h.request_id, h.prompt_ids, firsts[h.request_id], h.sampling, pull.local_blocks,
                          h.handle.feature, forks=h.forks, tenant=h.tenant, fork_firsts=firsts,
                          cache_offset=h.handle.cache_offset)
            joined = True
            for rid in h.members:           # a member whose stream ended meanwhile runs for nobody
                if not self.loop.has_stream(rid):
                    e.abort(rid)
        except Exception as exc:  # noqa: BLE001 - the request's own fault: it ends here
            for rid in h.members:
                self.loop.fail(rid, RequestError(str(exc)) if isinstance(exc, ValueError) else exc)
            return False
        finally:
            if not joined:
                e.scheduler.release_external(pull.local_blocks)
        return True

    def _prefix_landed(self, e: LLMEngine, pull: KVPull, h: PendingPull) -> None:
        """A fetched prefix's pull ended: its blocks join this pool's prefix cache (checked by the
        transport's checksums), then the request starts here and finds them as prefix hits."""
        keys = []
        if pull.state is PullState.DONE:
            bs = e.layout.block_size
            n = h.handle.num_tokens // bs
            keys = e.prefix_keys(h.prompt_ids[:n * bs], h.sampling.cache_salt)
            self.counters.fetched += 1
            self.counters.fetched_blocks += n
            self.counters.bytes += len(h.handle.block_ids) * e.transfer_layout.bytes_per_block()
            if e.kv_export is not None:
                e.kv_export.scatter(pull.local_blocks)
            self.counters.seconds += pull.timings.get("acked", pull.timings["start"]) - pull.timings["start"]
        else:
            self.counters.fetch_failed += 1
            log.warning("prefix fetch for %s failed (%s); computing the prompt", h.request_id, pull.error)
        e.scheduler.release_external(pull.local_blocks, cache_keys=keys)
        try:
            self.start_generate(e, h.prefix_of)
        except Exception as exc:  # noqa: BLE001 - the request's own fault (a bad option): it ends here
            for rid in h.members:
                self.loop.fail(rid, exc)

    def observe(self, deltas: list[TokenDelta]) -> None:
        """On the engine thread, each step's deltas before they leave: the first of a joined
        handoff ends its timing (`HandoffTiming.join`)."""
        if not self.joined:
            return
        for d in deltas:
            h = self.joined.pop(d.request_id, None)
            if h is not None:
                self._timed(h)

    def _timed(self, h: PendingPull) -> None:
        h.times["first_step"] = time.time()
        gaps = [max(0.0, h.times[b] - h.times[a]) for a, b in zip(PHASES, PHASES[1:])]
        self.timings.append(HandoffTiming(h.request_id, len(h.handle.block_ids), *gaps))

    def _recompute(self, e: LLMEngine, h: PendingPull, why: str) -> None:
        """The pull failed (the producer died, a bad checksum): compute the prompt here. The
        first token was sampled by the producer, so the generator skips that draw."""
        self.counters.failed += 1
        log.warning("handoff of %s failed (%s); recomputing here", h.request_id, why)
        firsts = h.handle.first_tokens()       # one per member: checked by `open_handle`
        for rid, sampling in ((h.request_id, h.sampling), *((f.request_id, f.sampling) for f in h.forks)):
            first = firsts[rid]
            rest = replace(sampling, max_tokens=sampling.max_tokens - 1, prompt_logprobs=None)
            try:
                e.add_request([*h.prompt_ids, first], rest, rid, tenant=h.tenant)
                e.skip_samples(rid, 1)
            except Exception as exc:  # noqa: BLE001
                self.loop.fail(rid, RequestError(str(exc)) if isinstance(exc, ValueError) else exc)


def add_prefilled(e: LLMEngine, request_id: str, prompt_ids: Seq[int], first_token: int,
                  sampling: SamplingParams, block_ids: Seq[int], feature: bytes = b"",
                  forks: Seq[Fork] = (), tenant: str = "", fork_firsts: Mapping[str, int] | None = None,
                  cache_offset: int = 0) -> None:
    """Join a sequence whose prompt KV already sits in `block_ids` (taken from the engine's
    scheduler and filled by a transfer) and whose first token was sampled elsewhere. It decodes
    from its second token on, waiting with its blocks while the pool is full; if it is ever
    preempted, or its KV is discarded to avoid a deadlock, it is recomputed here. `forks`: more
    samples of the prompt, on the same blocks, each from its first token in `fork_firsts` (by
    request id: `KVHandle.first_tokens()`). `feature`: the proposer state the producer exported
    beside the blocks (`Speculator.export_state`; with an EAGLE head the target's hidden state at
    the prompt's last position), checked by this engine's speculator. `cache_offset`: the prompt's
    tokens the blocks leave out (a compacted prompt, cluster/engine/compaction.py): it decodes on
    them as its producer would have, speculation off, its blocks never published."""
    ids = e.validate_prompt(list(prompt_ids))
    fork_firsts = fork_firsts or {}
    if any(f.request_id not in fork_firsts for f in forks):
        raise ValueError("a handed-off fork needs the first token its producer drew")
    for sp in (sampling, *(f.sampling for f in forks)):
        e.validate_speculation(sp)
    e.requests.check_free([request_id, *(f.request_id for f in forks)])
    need = -(-(len(ids) - cache_offset) // e.layout.block_size)
    if len(block_ids) != need:
        raise ValueError(f"{len(ids)} prompt tokens need {need} blocks, got {len(block_ids)}")
    if cache_offset and forks:
        raise ValueError("a compacted prompt is not forked (kv_compaction with n > 1)")
    if cache_offset:
        sampling = replace(sampling, speculative="off", num_speculative_tokens=None)
    spec_state = e.speculator.import_state(feature, len(ids))
    lead = _prefilled_sequence(e, request_id, ids, sampling, first_token, spec_state, tenant)
    lead.block_ids, lead.num_computed_tokens = list(block_ids), len(ids)
    lead.compaction_offset = cache_offset
    lead.compacted = bool(cache_offset) or lead.kv_compaction is not None
    e.scheduler.add(lead)
    for fork in forks:
        child = _prefilled_sequence(e, fork.request_id, ids, fork.sampling, fork_firsts[fork.request_id], spec_state,
                                    tenant)
        if not e.scheduler.fork(lead, child, len(ids), e.kv_cache.copy_block):
            e.scheduler.add(child)      # no block for its copy: it computes the prompt itself


def _prefilled_sequence(e: LLMEngine, request_id: str, ids: list[int], sampling: SamplingParams,
                        first_token: int, spec_state: object | None, tenant: str) -> Sequence:
    # Its prompt (and prompt logprobs) were computed by the producer.
    seq = e.new_sequence(request_id, ids, sampling, token_ids=[*ids, int(first_token)], prompt_logprobs_sent=True,
                         spec_state=spec_state, tenant=tenant)
    if not sampling.greedy and seq.generator is not None:
        # The producer drew the first token from the same seed: skip that draw so a seeded
        # request samples the same tokens as it would in one engine.
        e.skip_draws(seq.generator, 1)
    # Replays the producer's text state; its text was streamed there.
    e.requests.detok[request_id].add([int(first_token)])
    return seq
