"""A request's calls on its workers: the remote prefill, then decode attempts until every member
(the request and its forks) has ended, with the failover between them.

A decode attempt is a Ray control call (it returns when the request ends, raises when the worker
dies) plus the deltas that arrive over the token stream (`cluster/token_stream.py`), keyed per
attempt, so that a late frame from a dead worker never reaches its retry. One request and the n
samples of a prompt take the same decode path (`Attempts.decode`), whose one exception ladder is
`Attempts._attempt_failed`: whose fault an error is (`cluster/errors.py`) decides what follows.
A prefill worker that fails is replaced by another (or by the decode worker itself); a decode
worker that fails mid-stream is replaced by another that recomputes from the prompt plus every
token already streamed (its seeded generator resumed past them).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

from cluster.errors import RequestError, WorkerBusy, error_message
from cluster.token_stream import StreamBroken, StreamQueue, TokenReceiver
from cluster.types import Fork, GenerateRequest, TokenDelta, merge_deltas
from cluster.worker_messages import DecodeCall, GenerateCall, PrefillCall, PrefillResult
from router.policy import WorkerView
from router.router_config import RouterConfig
from router.worker_pool import ShuttingDown, WorkerPool
from router.workers import WorkerClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prefilled:
    """A remote prefill's outcome as the decode attempts read it: the worker's result, each
    member's first delta (already streamed to the client) and the prefill worker holding the lease."""
    result: PrefillResult
    firsts: Mapping[str, TokenDelta]
    worker: str


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

    async def decode(self, members: list[GenerateRequest], dec: WorkerView, hashes, prefilled: Prefilled | None,
                     streamed: dict[str, list[int]], prefix: bytes | None = None) -> AsyncIterator[TokenDelta]:
        """Attempts on decode workers until every member has ended. The first continues the handoff
        (`prefilled`) into every member, or computes the prompt there once (first pulling `prefix`,
        a handle another worker exported, when given). When an attempt fails,
        each unfinished member goes on alone from the prompt plus every token it has streamed (its
        seeded generator resumed past them): on another worker, or on a busy one once it has room."""
        failures, busy_wait = 0, 0.02
        while True:
            view, done = dec, set()
            try:
                async for d in self._attempt(members, view, prefilled, streamed, prefix):
                    if d.finished:
                        done.add(d.request_id)
                    yield d
                view.remember(hashes)
                return
            except (asyncio.CancelledError, RequestError, ShuttingDown):
                raise
            except Exception as exc:  # noqa: BLE001 - busy or failed: `_attempt_failed` says which
                busy = self._attempt_failed(view, members[0].request_id, exc, prefilled)
                prefilled = prefix = None
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
            async for d in self._stream(self.workers.clients[view.name], members[0].request_id, make, forks):
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
        asyncio.ensure_future(_quietly(self.workers.clients[prefill_worker].abort(request_id)))

    async def _stream(self, client: WorkerClient, request_id: str,
                      make: Callable[..., GenerateCall | DecodeCall], forks: tuple[Fork, ...] = ()
                      ) -> AsyncIterator[TokenDelta]:
        """One attempt on one worker: start it with a control call (`make(sink, key, forks=...)`,
        each fork given its own stream key), read its deltas from the token stream. Several deltas
        that arrived together leave as one (a lagging reader coalesces). The attempt ends when the
        request and every fork have finished."""
        key, queue = self.receiver.open(request_id)
        forks = tuple(replace(f, stream_key=self.receiver.open(f.request_id, queue)[0]) for f in forks)
        keys = [key, *(f.stream_key for f in forks)]
        running, watch = 1 + len(forks), None
        try:
            call = make(self.receiver.address, key, forks=forks)
            ref = client.decode(call) if isinstance(call, DecodeCall) else client.generate(call)
            watch = asyncio.ensure_future(self._watch(ref, queue))
            while True:
                items = await queue.take()
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                for delta in (merge_deltas(items),) if not forks else _merge_per_request(items):
                    yield delta
                    if delta.finish_reason is not None:
                        running -= 1
                if running == 0:
                    return
        finally:
            for k in keys:
                self.receiver.close_key(k)
            if watch is not None:
                watch.cancel()

    async def _watch(self, call, queue: StreamQueue) -> None:
        """The attempt's control call: it raises if the worker dies (Ray knows), and returns once the
        request has ended, by which time its last frame is on the wire."""
        try:
            await call
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.push(exc)
            return
        await asyncio.sleep(self.config.final_delta_grace_s)
        queue.push(StreamBroken("the worker ended the request but its last delta never arrived"))


def _merge_per_request(items: list[TokenDelta]) -> list[TokenDelta]:
    """Deltas of several requests as one per request, in the order each first appeared."""
    by_id: dict[str, list[TokenDelta]] = {}
    for d in items:
        by_id.setdefault(d.request_id, []).append(d)
    return [merge_deltas(ds) for ds in by_id.values()]


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they come; the first error ends them all."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(end)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await queue.put(exc)
    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _quietly(coro) -> None:
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - best effort: a lease also expires on its own
        log.info("releasing a lease failed: %s", exc)
