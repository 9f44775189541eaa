"""A request's calls on its workers: the remote prefill, then decode attempts until every member
(the request and its forks) has ended, with the failover between them.

A handed-off request (`Attempts.handoff`) costs one Ray call: to the prefill worker, which streams
the first deltas as its prefill ends and starts the decode worker's decode itself (`HandOn`),
answering when that has ended, with the decode call's error inside if it raised. That call is the
first decode attempt (`_handed_on`): its errors take the same ladder as the router's own calls.

A decode attempt is a Ray control call (it returns when the request ends, raises when the worker
dies) plus the deltas that arrive over the token stream, keyed per attempt
(`router/attempt_stream.py`), so that a late frame from a dead worker never reaches its retry. One request and the n
samples of a prompt take the same decode path (`Attempts.decode`), whose one exception ladder is
`Attempts._attempt_failed`: whose fault an error is (`cluster/errors.py`) decides what follows.
A prefill worker that fails is replaced by another (or by the decode worker itself); a decode
worker that fails mid-stream is replaced by another that recomputes from the prompt plus every
token already streamed (its seeded generator resumed past them). A decode worker being drained
(`drain`, cluster/launch/admin.py) hands its attempts on: a lone greedy sequence's KV moves to
the next decode worker as a handoff (`moved_request`), any other resumes there the same way.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

from cluster.errors import RequestError, WorkerBusy, error_message
from cluster.token_stream import TokenReceiver
from cluster.types import Fork, GenerateRequest, TokenDelta
from cluster.worker_messages import (
    DecodeCall,
    GenerateCall,
    HandOn,
    PrefillCall,
    PrefillResult,
)
from router.attempt_stream import AttemptStreams, CallFailed, NotHandedOn
from router.merging import merge_streams, with_prefill_hits
from router.policy import WorkerView
from router.router_config import RouterConfig
from router.worker_pool import Drained, ShuttingDown, WorkerPool
from router.workers import WorkerClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prefilled:
    """A remote prefill's outcome as the decode attempts read it: the worker's result, each
    member's first delta (already streamed to the client) and the prefill worker holding the lease."""
    result: PrefillResult
    firsts: Mapping[str, TokenDelta]
    worker: str
    resumed: GenerateRequest | None = None   # a moved request as its handle continues it (`moved_request`)


def moved_request(req: GenerateRequest, done: list[int]) -> GenerateRequest:
    """A request whose KV moved to another decode worker after it streamed `done`: its prompt now
    ends before the last streamed token, which the handle carries as its first."""
    sampling = replace(req.sampling, max_tokens=req.sampling.max_tokens - len(done) + 1, prompt_logprobs=None)
    return replace(req, prompt_token_ids=(*req.prompt_token_ids, *done[:-1]), sampling=sampling)


class NoPrefillTaken(Exception):
    """No prefill worker took a handoff (none routable, or each failed or was busy) before any delta
    streamed: the decode worker computes the prompt."""


class HandOnLost(RuntimeError):
    """The prefill worker of a handed-on request failed after its first deltas streamed: the decode
    it started is aborted and the request continues as after a failed decode attempt."""


class _PrefillFailed(Exception):
    """The one call's prefill worker failed or declined before any delta: the next one is tried."""


class Attempts:
    def __init__(self, config: RouterConfig, workers: WorkerPool, receiver: TokenReceiver,
                 active: dict[str, list[str]], metrics=None):
        """`active`: the router's registry, request id -> the workers holding it (what an abort reaches)."""
        self.config = config
        self.workers = workers
        self.receiver = receiver
        self.active = active
        self.metrics = metrics
        self.recoveries = 0                      # streams continued on another worker after a failure
        self.busy_retries = 0                    # handoffs a full decode worker declined
        self.worker_calls = 0                    # Ray calls made on workers for requests (data calls, aborts)
        self.streams = AttemptStreams(receiver, config.final_delta_grace_s)
        self.live = self.streams.live            # decode worker -> its attempts' queues (what a drain stops)

    async def prefill(self, req: GenerateRequest, hashes, forks: tuple[GenerateRequest, ...] = ()
                      ) -> Prefilled | None:
        """The prefill on the first prefill worker that takes it; None when every one failed or was busy."""
        tried = set()
        members = (req, *forks)
        call = PrefillCall(req.request_id, req.prompt_token_ids, req.sampling,
                           tuple(Fork(f.request_id, f.sampling) for f in forks), stats_sink=self.receiver.address)
        while True:
            candidates = [v for v in self.workers.healthy("prefill") if v.name not in tried]
            if not candidates:
                return None
            view = self.workers.policy.choose_prefill(hashes, candidates)
            tried.add(view.name)
            for m in members:
                self.active[m.request_id].append(view.name)
            view.in_flight += 1
            t0 = time.perf_counter()
            self.worker_calls += 1
            try:
                result = await self.workers.clients[view.name].prefill(call)
            except (asyncio.CancelledError, RequestError):
                raise
            except WorkerBusy as exc:
                log.info("prefill worker %s is full (%s); trying another", view.name, error_message(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - the worker's fault: try the next one
                log.warning("prefill worker %s failed (%s); trying another", view.name, error_message(exc))
                self.workers.worker_failed(view.name, exc)
                continue
            finally:
                view.in_flight -= 1
            view.remember(hashes)
            if self.metrics:
                self.metrics.observe_prefill(time.perf_counter() - t0)
            # Done there, but for a lease (kept under the request's id: aborting it releases the lease).
            for m in members:
                if m is not req or result.handle is None:
                    self.active[m.request_id].remove(view.name)
            return Prefilled(result, result.first_deltas(tuple(f.request_id for f in forks)), view.name)

    async def export_prefix(self, req: GenerateRequest, plan) -> bytes | None:
        """Have `plan.source` export the prompt's first `plan.blocks` blocks (loaded from its tiers,
        published under a lease kept under the request's id, as a prefill's is); the encoded handle
        for the decode worker to pull, or None when the source could not (the prompt is then
        computed as if no worker held it)."""
        n = plan.blocks * self.config.block_size
        call = PrefillCall(req.request_id, req.prompt_token_ids[:n],
                           replace(req.sampling, max_tokens=1, logprobs=None, prompt_logprobs=None, structured=None,
                                   speculative=None, num_speculative_tokens=None),
                           stats_sink=self.receiver.address, export=True)
        self.active[req.request_id].append(plan.source)
        self.worker_calls += 1
        try:
            result = await self.workers.clients[plan.source].prefill(call)
        except (asyncio.CancelledError, RequestError):
            raise
        except Exception as exc:  # noqa: BLE001 - busy or failed: the prompt is computed instead
            log.info("prefix export from %s failed (%s); computing it", plan.source, error_message(exc))
            self.active[req.request_id].remove(plan.source)
            return None
        if result.handle is None:
            self.active[req.request_id].remove(plan.source)
        return result.handle

    async def handoff(self, members: list[GenerateRequest], dec: WorkerView, hashes,
                      streamed: dict[str, list[int]]) -> AsyncIterator[TokenDelta]:
        """A disaggregated request in one call: prefilled on the first prefill worker that takes
        it, which hands it on to `dec` (the first deltas stream as its prefill ends), then decode
        attempts as `decode`'s. `NoPrefillTaken`, before any delta, when no prefill worker took it."""
        tried = set()
        while True:
            candidates = [v for v in self.workers.healthy("prefill") if v.name not in tried]
            if not candidates:
                raise NoPrefillTaken()
            via = self.workers.policy.choose_prefill(hashes, candidates)
            tried.add(via.name)
            try:
                async for d in self.decode(members, dec, hashes, None, streamed, via=via):
                    yield d
                return
            except _PrefillFailed:
                continue

    async def decode(self, members: list[GenerateRequest], dec: WorkerView, hashes, prefilled: Prefilled | None,
                     streamed: dict[str, list[int]], prefix: bytes | None = None, via: WorkerView | None = None
                     ) -> AsyncIterator[TokenDelta]:
        """Attempts on decode workers until every member has ended. The first continues the handoff
        (`prefilled`) into every member, or is the one call on prefill worker `via` that hands the
        request on (`_handed_on`), or computes the prompt there once (first pulling `prefix`,
        a handle another worker exported, when given). When an attempt fails,
        each unfinished member goes on alone from the prompt plus every token it has streamed (its
        seeded generator resumed past them): on another worker, or on a busy one once it has room."""
        failures, busy_wait = 0, 0.02
        firsts = dict(prefilled.firsts) if prefilled is not None else {}   # each member's from its prefill
        while True:
            view, done = dec, set()
            try:
                attempt = (self._attempt(members, view, prefilled, streamed, prefix) if via is None
                           else self._handed_on(members, view, via, hashes, firsts))
                async for d in attempt:
                    if d.finished:
                        done.add(d.request_id)
                    yield with_prefill_hits(d, firsts)
                view.remember(hashes)
                return
            except (asyncio.CancelledError, RequestError, ShuttingDown, _PrefillFailed):
                raise
            except Drained:     # its worker is drained: its KV moves to a peer, or each member resumes
                members = [m for m in members if m.request_id not in done]
                moved = await self._drained(members, view, via, prefilled, streamed)
                busy, prefilled, prefix, via = False, moved, None, None
            except NotHandedOn as answer:      # the router hands it on itself, as its first attempt
                prefilled, via = self._answered(members, view, via, answer.result), None
                firsts.update(prefilled.firsts)
                for first in prefilled.firsts.values():
                    yield first
                members = [m for m in members if not prefilled.firsts[m.request_id].finished]
                if not members:
                    return
                continue
            except Exception as exc:  # noqa: BLE001 - busy or failed: `_attempt_failed` says which
                busy = self._attempt_failed(view, members[0].request_id, exc, prefilled)
                prefilled = prefix = via = None
                failures += not busy
                if failures >= self.config.max_attempts:
                    raise
            members = [m for m in members if m.request_id not in done]
            dec, slept = await self._next_decode(view, hashes, busy, busy_wait)
            busy_wait = min(1.0, busy_wait * 2) if slept else busy_wait
            if len(members) != 1:       # from here on each member resumes from its own tokens
                async for d in merge_streams([self.decode([m], dec, hashes, None, streamed) for m in members]):
                    yield d
                return

    async def _handed_on(self, members: list[GenerateRequest], dec: WorkerView, via: WorkerView, hashes,
                         firsts: dict[str, TokenDelta]) -> AsyncIterator[TokenDelta]:
        """The one call of a handed-off request: on prefill worker `via`, naming decode worker `dec`;
        the deltas of both come over the token stream, each member's first recorded in `firsts`.
        The decode call's error comes back in the answer and is raised here as its own; the call's
        own failure is the prefill worker's (`_prefill_failed`)."""
        lead = members[0]
        for m in members:
            self.active[m.request_id] += [via.name, dec.name]
        via.in_flight += 1
        dec.in_flight += 1
        prefilling, t0 = True, time.perf_counter()

        def make(sink, key, forks=()) -> PrefillCall:
            return PrefillCall(lead.request_id, lead.prompt_token_ids, lead.sampling, forks, stats_sink=sink,
                               hand_on=HandOn(dec.name, sink, key, sent_at=time.time(), tenant=lead.tenant))
        try:
            async for d in self.streams.run(self._start, self.workers.clients[via.name], lead.request_id, make,
                                        tuple(Fork(m.request_id, m.sampling) for m in members[1:]), firsts,
                                        drains=dec.name):
                if prefilling:
                    prefilling = False
                    via.in_flight -= 1
                    via.remember(hashes)
                    if self.metrics:
                        self.metrics.observe_prefill(time.perf_counter() - t0)
                yield d
        except CallFailed as failed:
            raise await self._prefill_failed(members, dec, via, failed.cause, after_first=not prefilling) from None
        finally:
            via.in_flight -= prefilling
            dec.in_flight -= 1

    async def _prefill_failed(self, members: list[GenerateRequest], dec: WorkerView, via: WorkerView,
                              exc: BaseException, after_first: bool) -> Exception:
        """What follows when the one call's prefill worker failed or declined: before any delta the
        next prefill worker is tried (`_PrefillFailed`), after it the request fails over from what
        it streamed (`HandOnLost`). A failed one may have handed on already: the decode is aborted
        first, and waited for, so that no retry on that decode worker meets the abort."""
        if isinstance(exc, WorkerBusy):
            log.info("prefill worker %s is full (%s); trying another", via.name, error_message(exc))
        else:
            log.warning("prefill worker %s failed (%s)", via.name, error_message(exc))
            self.workers.worker_failed(via.name, exc)
            await asyncio.gather(*(self.abort_on(dec.name, m.request_id) for m in members), return_exceptions=True)
        for m in members:
            for name in (via.name, dec.name):
                if name in self.active[m.request_id]:
                    self.active[m.request_id].remove(name)
        if after_first:
            return HandOnLost(f"prefill worker {via.name} failed after handing on ({error_message(exc)})")
        return _PrefillFailed(error_message(exc))

    def _answered(self, members: list[GenerateRequest], dec: WorkerView, via: WorkerView,
                  result: PrefillResult) -> Prefilled:
        """A prefill worker's answer that it did not hand on, as a remote prefill's outcome: done
        there but for the lead's lease; the decode worker is called by the attempt that follows."""
        for m in members:
            self.active[m.request_id].remove(dec.name)
            if m is not members[0] or result.handle is None:
                self.active[m.request_id].remove(via.name)
        return Prefilled(result, result.first_deltas(tuple(m.request_id for m in members[1:])), via.name)

    def _attempt_failed(self, view: WorkerView, request_id: str, exc: Exception, prefilled: Prefilled | None
                        ) -> bool:
        """The one exception ladder of a decode attempt (the client's fault and a shutdown are raised
        before it): True when the worker was busy (it declined the handoff: try elsewhere or later),
        False when it failed (routed around if Ray says it died). Either way the handoff's lease is
        of no use any more: its pins are released at once."""
        busy = isinstance(exc, WorkerBusy)
        if busy:
            self.busy_retries += 1
            log.info("decode worker %s declined %s (%s)", view.name, request_id, error_message(exc))
        else:
            log.warning("decode worker %s failed on %s (%s)", view.name, request_id, error_message(exc))
            self.workers.worker_failed(view.name, exc)
            self.recoveries += 1
        if prefilled is not None:
            self._release_lease(prefilled.worker, prefilled.result.request_id)
        return busy

    def drain(self, worker: str) -> int:
        """Stop every attempt on decode worker `worker` (its requests go on elsewhere, `_drained`);
        how many it stopped. The caller has taken the worker out of routing first."""
        queues = self.live.get(worker, set())
        for queue in queues:
            queue.push(Drained(worker))
        return len(queues)

    async def _drained(self, members: list[GenerateRequest], view: WorkerView, via: WorkerView | None,
                       prefilled: Prefilled | None, streamed: dict[str, list[int]]) -> Prefilled | None:
        """An attempt stopped by a drain: a lone greedy request's KV moves to a peer (the next
        attempt continues the handle it answers with, `moved_request`); otherwise its members are
        aborted on the drained worker (and on the prefill worker handing them on), waited for so
        that its blocks are free, and resumed by recomputation from the tokens they streamed."""
        holders = [view.name, *([via.name] if via is not None else [])]
        moved = await self._move(members, view, streamed)
        if moved is None:
            await asyncio.gather(*(self.abort_on(w, m.request_id) for w in holders for m in members),
                                 return_exceptions=True)
        for m in members:
            self.active[m.request_id] = [w for w in self.active.get(m.request_id, []) if w not in holders]
        if prefilled is not None:
            self._release_lease(prefilled.worker, prefilled.result.request_id)
        outcome = "moved" if moved is not None else "recomputed"
        log.info("decode worker %s drained: %d sequence(s) %s", view.name, len(members), outcome)
        if self.metrics and members:
            self.metrics.count_drained(outcome, len(members))
        return moved

    async def _move(self, members: list[GenerateRequest], view: WorkerView, streamed: dict[str, list[int]]
                    ) -> Prefilled | None:
        if len(members) != 1 or members[0].sampling.temperature != 0 or not streamed[members[0].request_id]:
            return None     # n samples share blocks, a seeded one its generator: recomputed instead
        lead, done = members[0], streamed[members[0].request_id]
        try:
            handle = await self.workers.clients[view.name].export_running(lead.request_id, len(done))
        except Exception as exc:  # noqa: BLE001 - not a switchable worker, or it failed: recomputed
            log.info("moving %s off %s failed (%s); recomputing it", lead.request_id, view.name, error_message(exc))
            return None
        if handle is None:
            return None
        first = TokenDelta(lead.request_id, (done[-1],), "")
        return Prefilled(PrefillResult(lead.request_id, first, handle), {}, view.name, moved_request(lead, done))

    async def _next_decode(self, view: WorkerView, hashes, busy: bool, wait: float) -> tuple[WorkerView, bool]:
        """Where the next attempt goes, and whether it waited `wait` s first: after a decline, another
        worker with free blocks (none: any, after the wait); after a failure, another routable one."""
        policy = self.workers.policy
        if busy:
            others = [v for v in self.workers.healthy("decode") if v is not view and v.blocks_free > 0]
            if others:
                return policy.choose_decode(hashes, others), False
            await asyncio.sleep(wait)
            return policy.choose_decode(hashes, await self.workers.routable("decode")), True
        candidates = await self.workers.routable("decode")
        return policy.choose_decode(hashes, [v for v in candidates if v is not view] or candidates), False

    async def _attempt(self, members: list[GenerateRequest], view: WorkerView, prefilled: Prefilled | None,
                       streamed: dict[str, list[int]], prefix: bytes | None = None) -> AsyncIterator[TokenDelta]:
        """One attempt of `members` on one decode worker."""
        for m in members:
            self.active[m.request_id].append(view.name)
        view.in_flight += 1
        try:
            make, forks = self._call(members, prefilled, streamed, prefix)
            async for d in self.streams.run(self._start, self.workers.clients[view.name], members[0].request_id, make, forks,
                                        drains=view.name):
                yield d
        finally:
            view.in_flight -= 1

    @staticmethod
    def _call(members: list[GenerateRequest], prefilled: Prefilled | None, streamed: dict[str, list[int]],
              prefix: bytes | None = None) -> tuple[Callable[..., GenerateCall | DecodeCall], tuple[Fork, ...]]:
        """What an attempt asks of its worker: continue the handoff into every member, resume a
        failover from the tokens already streamed (a member alone by then), or compute the prompt
        there once. The call lacks its stream (sink, key: `_stream` opens them) and comes with its forks."""
        lead, rest = members[0], members[1:]
        if prefilled is not None:
            lead = prefilled.resumed or lead
            # Every member's first token travels in the handle.
            return (partial(DecodeCall, lead.request_id, lead.prompt_token_ids, lead.sampling, prefilled.result.handle,
                            sent_at=time.time(), tenant=lead.tenant),
                    tuple(Fork(m.request_id, m.sampling) for m in rest))
        done = tuple(streamed[lead.request_id])
        if done:
            left = replace(lead.sampling, max_tokens=max(1, lead.sampling.max_tokens - len(done)), prompt_logprobs=None)
            return partial(GenerateCall, lead.request_id, (*lead.prompt_token_ids, *done), left,
                           resume_samples=len(done), tenant=lead.tenant), ()
        return (partial(GenerateCall, lead.request_id, lead.prompt_token_ids, lead.sampling, tenant=lead.tenant,
                        prefix_handle=prefix),
                tuple(Fork(m.request_id, m.sampling) for m in rest))

    def _release_lease(self, prefill_worker: str, request_id: str) -> None:
        workers = self.active.get(request_id, [])
        if prefill_worker in workers:
            workers.remove(prefill_worker)
        asyncio.ensure_future(_quietly(self.abort_on(prefill_worker, request_id)))

    def abort_on(self, worker: str, request_id: str):
        """The abort call of `request_id` on `worker` (a coroutine: the caller awaits it)."""
        self.worker_calls += 1
        client = self.workers.clients.get(worker)
        return client.abort(request_id) if client is not None else asyncio.sleep(0)   # removed: nothing held

    def _start(self, client: WorkerClient, call: GenerateCall | DecodeCall | PrefillCall):
        self.worker_calls += 1
        if isinstance(call, PrefillCall):
            return client.prefill(call)
        return client.decode(call) if isinstance(call, DecodeCall) else client.generate(call)

async def _quietly(coro) -> None:
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - best effort: a lease also expires on its own
        log.info("releasing a lease failed: %s", exc)
