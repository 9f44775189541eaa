"""Orchestrates one request: pick workers, prefill (or not), hand the KV to decode, stream tokens.

The first token is yielded as soon as the prefill worker returns it, before the decode worker has
pulled the KV. The decode worker's deltas arrive over the token stream (`TokenReceiver`, one frame
per engine step for all of this frontend's requests); the control call that started them returns
when the request ends, and raises if the worker dies. A prefill worker that fails is replaced by another (or by the decode worker
itself); a decode worker that fails mid-stream is replaced by another that recomputes from the
prompt plus every token already streamed (its seeded generator resumed past them), so the client
loses nothing but time.

Whose fault an error is decides what happens (`cluster/errors.py`): a `RequestError` goes to the
client and leaves the worker in routing; `WorkerBusy` (no room for a handoff) continues the
request on another worker, or on the same one once it has room; only a dead worker (Ray says so)
leaves routing, until its new incarnation is back (`router/health.py`). Requests wait, within their
deadline, for a worker to route to: before the cluster is ready, and while every worker of a role
is restarting.

Workers are called through `router/workers.py` with the typed messages of
`cluster/worker_messages.py`; one request and the n samples of a prompt take the same decode path
(`_decode`), whose one exception ladder is `_attempt_failed`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

from cluster.config import derived, require, setting
from cluster.errors import RequestError, WorkerBusy, error_message
from cluster.kv.hashing import hash_prefix_blocks
from cluster.token_stream import StreamBroken, TokenReceiver
from cluster.types import Fork, GenerateRequest, TokenDelta, merge_deltas
from cluster.worker_messages import DecodeCall, GenerateCall, PrefillCall, PrefillResult, WorkerStats
from router.health import Change, WorkerHealth, is_actor_death
from router.policy import WorkerView
from router.workers import WorkerClient


class ShuttingDown(RuntimeError):
    """The server is stopping: the stream ends with UNAVAILABLE, and the client may retry elsewhere."""


class NoWorker(RuntimeError):
    """No worker of a role became routable within `RouterConfig.unavailable_wait_s`."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prefilled:
    """A remote prefill's outcome as the decode attempts read it: the worker's result, each
    member's first delta (already streamed to the client) and the prefill worker holding the lease."""
    result: PrefillResult
    firsts: Mapping[str, TokenDelta]
    worker: str


@dataclass
class RouterConfig:
    block_size: int = derived(16, "the engines' KV block size (--block-size): the policy hashes prompts by block")
    colocated: bool = derived(False, "--colocated: every worker runs both phases")
    local_prefill_max_tokens: int = setting(32, "prompts this short are prefilled on the decode worker "
                                                "(conditional disaggregation)")
    local_prefill_cached_fraction: float = setting(0.9, "... and so are prompts this much of which is cached there")
    final_delta_grace_s: float = setting(30.0, "after a stream's worker call returns, its last tokens must arrive "
                                               "within this")
    stall_timeout_s: float = setting(60.0, "route around a live worker that has work queued but has made no engine "
                                           "step for this long, until it moves again (a slow worker is never "
                                           "routed around)")
    unavailable_wait_s: float = setting(120.0, "how long a request waits for a routable worker of a role (the "
                                               "cluster starting, or every such worker restarting)")
    max_attempts: int = setting(8, "decode attempts per request (failovers and busy retries)")

    def __post_init__(self) -> None:
        require(self.local_prefill_max_tokens >= 0, "local_prefill_max_tokens",
                f"must be >= 0, got {self.local_prefill_max_tokens}")
        require(0 <= self.local_prefill_cached_fraction <= 1, "local_prefill_cached_fraction",
                f"must be in [0, 1], got {self.local_prefill_cached_fraction}")
        for name in ("final_delta_grace_s", "stall_timeout_s", "unavailable_wait_s"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(self.max_attempts >= 1, "max_attempts", f"must be >= 1, got {self.max_attempts}")


class Router:
    def __init__(self, config: RouterConfig, policy, prefill: dict[str, WorkerClient],
                 decode: dict[str, WorkerClient], receiver: TokenReceiver, metrics=None):
        """`prefill`/`decode`: worker name -> client (see cluster/launch/app.py)."""
        self.config = config
        self.receiver = receiver
        self.policy = policy
        self.clients = {**prefill, **decode}
        self.views = {n: WorkerView(n, "prefill", healthy=False) for n in prefill} | \
            {n: WorkerView(n, "decode", healthy=False) for n in decode}
        self.health = {n: WorkerHealth(n, stall_s=config.stall_timeout_s) for n in self.views}
        self._routable_changed = asyncio.Event()
        self.closing = False
        self.in_flight = 0
        self.activity = asyncio.Event()          # set by each new request: wakes an idle stats poll
        self.metrics = metrics
        self.active: dict[str, list[str]] = {}   # request id -> workers holding it
        self.owner: dict[str, str] = {}          # request id -> its tenant (only it may abort it)
        self.recoveries = 0                      # streams continued on another worker after a failure
        self.busy_retries = 0                    # handoffs a full decode worker declined

    def _healthy(self, role: str) -> list[WorkerView]:
        return [v for v in self.views.values() if v.role == role and v.healthy]

    @property
    def ready(self) -> bool:
        """Every worker has loaded and been handshaken at least once (gRPC health: SERVING)."""
        return all(v.healthy for v in self.views.values())

    def worker_polled(self, name: str, stats: WorkerStats) -> None:
        """A stats poll answered: the routing view's load figures, and the worker's health."""
        first_start = self.health[name].incarnation is None
        change = self.health[name].observe(stats)
        view = self.views[name]
        if change is Change.NEW_INCARNATION:
            view.cached.clear()            # a restarted worker's prefix cache is empty
        if change is not Change.NONE:
            # A worker's first incarnation is the cluster starting, not news an operator must act on.
            (log.info if first_start else log.warning)("worker %s: %s (now %s)", name, change.value,
                                                       self.health[name].state.value)
        self.update_stats(stats)
        self._set_routable(view)

    def worker_failed(self, name: str, exc: BaseException) -> None:
        """A call to the worker raised. Only Ray's word that the actor died takes it out of routing;
        a timeout or an error of the call's own is not a dead worker."""
        if is_actor_death(exc) and self.health[name].died() is Change.DIED:
            log.warning("worker %s died (%s); routing around it until it is back", name, type(exc).__name__)
            self._set_routable(self.views[name])

    async def routing_changed(self) -> None:
        """Returns at the next change of any worker's routability."""
        await self._routable_changed.wait()

    def _set_routable(self, view: WorkerView) -> None:
        routable = self.health[view.name].routable
        if routable != view.healthy:
            view.healthy = routable
            self._routable_changed.set()
            self._routable_changed = asyncio.Event()

    async def _routable(self, role: str) -> list[WorkerView]:
        """The routable workers of `role`, waiting (within the request's deadline, which the server
        enforces around us) while there are none: the cluster is starting, or they are restarting."""
        limit = time.monotonic() + self.config.unavailable_wait_s
        while not (views := self._healthy(role)):
            if self.closing:
                raise ShuttingDown("the server is shutting down")
            left = limit - time.monotonic()
            if left <= 0:
                raise NoWorker(f"no {role} worker became available within {self.config.unavailable_wait_s:.0f}s")
            try:
                await asyncio.wait_for(self._routable_changed.wait(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        return views

    def update_stats(self, stats: WorkerStats) -> None:
        view = self.views.get(stats.name)
        if view is not None:
            view.blocks_free = stats.blocks_free
            view.blocks_total = stats.blocks_total
            view.running = stats.running

    def check_capacity(self, req: GenerateRequest) -> None:
        """Refuse, before anything is scheduled, a prompt no decode worker can ever hold (its KV
        plus the first generated token), naming the numbers."""
        sizes = [v.blocks_total for v in self.views.values()
                 if v.role == "decode" and self.health[v.name].incarnation is not None]   # answered once
        if not sizes:
            return
        need = -(-(len(req.prompt_token_ids) + 1) // self.config.block_size)
        if need > max(sizes):
            raise RequestError(f"prompt: {len(req.prompt_token_ids)} tokens need {need} KV blocks of "
                               f"{self.config.block_size} tokens, but the largest decode worker holds {max(sizes)}; "
                               "shorten the prompt", "INVALID_ARGUMENT")

    async def abort(self, request_id: str, tenant: str | None = None) -> bool:
        """Stop a request everywhere. With `tenant`, only the owner's: another's is an unknown id."""
        if tenant is not None and self.owner.get(request_id, tenant) != tenant:
            return False
        workers = self.active.get(request_id, [])
        await asyncio.gather(*(self.clients[w].abort(request_id) for w in workers), return_exceptions=True)
        return bool(workers)

    async def generate(self, req: GenerateRequest, forks: tuple[GenerateRequest, ...] = ()
                       ) -> AsyncIterator[TokenDelta]:
        """Stream `req`'s deltas. `forks`: more samples of the same prompt (OpenAI's `n`), each
        with its own id and sampling: the prompt is computed once and its KV shared; their deltas
        come interleaved, each named by its request id."""
        members = (req, *forks)
        for m in members:
            if m.request_id in self.active:
                raise ValueError(f"request_id {m.request_id!r} is already running")
        if self.closing:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        self.in_flight += len(members)
        self.activity.set()
        streamed: dict[str, list[int]] = {}
        for m in members:
            self.active[m.request_id] = []
            self.owner[m.request_id] = m.tenant
            streamed[m.request_id] = []
        try:
            async for delta in self._generate(req, forks, streamed):
                streamed[delta.request_id].extend(delta.token_ids)
                if delta.finished:
                    self.active[delta.request_id] = []    # finished normally: nothing to abort
                yield delta
        finally:
            self.in_flight -= len(members)
            # One shielded task ends them all: a caller cancelled again while it waits (anyio's
            # cancel scopes re-cancel at every await) must not leave a member running.
            await asyncio.shield(self._end([m.request_id for m in members]))

    async def _end(self, request_ids: list[str]) -> None:
        """Abort what still runs of these requests, everywhere, and forget them."""
        await asyncio.gather(*(self.abort(rid) for rid in request_ids if self.active.get(rid)),
                             return_exceptions=True)
        for rid in request_ids:
            self.active.pop(rid, None)
            self.owner.pop(rid, None)

    async def _generate(self, req: GenerateRequest, forks: tuple[GenerateRequest, ...],
                        streamed: dict[str, list[int]]) -> AsyncIterator[TokenDelta]:
        self.check_capacity(req)
        hashes = hash_prefix_blocks(req.prompt_token_ids, self.config.block_size, req.sampling.cache_salt)
        dec = self.policy.choose_decode(hashes, await self._routable("decode"))
        cached = dec.cached_prefix(hashes)
        local = (self.config.colocated or len(req.prompt_token_ids) <= self.config.local_prefill_max_tokens
                 or (hashes and cached >= self.config.local_prefill_cached_fraction * len(hashes))
                 or not self._healthy("prefill"))
        prefilled = None
        members = [req, *forks]
        if not local:
            dec.in_flight += 1          # counted from the choice on, so requests arriving together spread
            try:
                prefilled = await self._prefill(req, hashes, forks)
            finally:
                dec.in_flight -= 1
            if prefilled is not None:   # None: no prefill worker could take it; the decode worker prefills
                for first in prefilled.firsts.values():
                    yield first
                members = [m for m in members if not prefilled.firsts[m.request_id].finished]
                if not members:
                    return
        async for d in self._decode(members, dec, hashes, prefilled, streamed):
            yield d

    async def _prefill(self, req: GenerateRequest, hashes, forks: tuple[GenerateRequest, ...] = ()
                       ) -> Prefilled | None:
        """The prefill on the first prefill worker that takes it; None when every one failed or was busy."""
        tried = set()
        members = (req, *forks)
        call = PrefillCall(req.request_id, req.prompt_token_ids, req.sampling,
                           tuple(Fork(f.request_id, f.sampling) for f in forks))
        while True:
            candidates = [v for v in self._healthy("prefill") if v.name not in tried]
            if not candidates:
                return None
            view = self.policy.choose_prefill(hashes, candidates)
            tried.add(view.name)
            for m in members:
                self.active[m.request_id].append(view.name)
            view.in_flight += 1
            t0 = time.perf_counter()
            try:
                result = await self.clients[view.name].prefill(call)
            except (asyncio.CancelledError, RequestError):
                raise
            except WorkerBusy as exc:
                log.info("prefill worker %s is full (%s); trying another", view.name, error_message(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - the worker's fault: try the next one
                log.warning("prefill worker %s failed (%s); trying another", view.name, error_message(exc))
                self.worker_failed(view.name, exc)
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

    async def _decode(self, members: list[GenerateRequest], dec: WorkerView, hashes, prefilled: Prefilled | None,
                      streamed: dict[str, list[int]]) -> AsyncIterator[TokenDelta]:
        """Attempts on decode workers until every member has ended. The first continues the handoff
        (`prefilled`) into every member, or computes the prompt there once. When an attempt fails,
        each unfinished member goes on alone from the prompt plus every token it has streamed (its
        seeded generator resumed past them): on another worker, or on a busy one once it has room."""
        failures, busy_wait = 0, 0.02
        while True:
            view, done = dec, set()
            try:
                async for d in self._attempt(members, view, prefilled, streamed):
                    if d.finished:
                        done.add(d.request_id)
                    yield d
                view.remember(hashes)
                return
            except (asyncio.CancelledError, RequestError, ShuttingDown):
                raise
            except Exception as exc:  # noqa: BLE001 - busy or failed: `_attempt_failed` says which
                busy = self._attempt_failed(view, members[0].request_id, exc, prefilled)
                prefilled = None
                failures += not busy
                if failures >= self.config.max_attempts:
                    raise
            members = [m for m in members if m.request_id not in done]
            dec, slept = await self._next_decode(view, hashes, busy, busy_wait)
            busy_wait = min(1.0, busy_wait * 2) if slept else busy_wait
            if len(members) != 1:       # from here on each member resumes from its own tokens
                async for d in merge_streams([self._decode([m], dec, hashes, None, streamed) for m in members]):
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
            self.worker_failed(view.name, exc)
            self.recoveries += 1
        if prefilled is not None:
            self._release_lease(prefilled.worker, prefilled.result.request_id)
        return busy

    async def _next_decode(self, view: WorkerView, hashes, busy: bool, wait: float) -> tuple[WorkerView, bool]:
        """Where the next attempt goes, and whether it waited `wait` s first: after a decline, another
        worker with free blocks (none: any, after the wait); after a failure, another routable one."""
        if busy:
            others = [v for v in self._healthy("decode") if v is not view and v.blocks_free > 0]
            if others:
                return self.policy.choose_decode(hashes, others), False
            await asyncio.sleep(wait)
            return self.policy.choose_decode(hashes, await self._routable("decode")), True
        candidates = await self._routable("decode")
        return self.policy.choose_decode(hashes, [v for v in candidates if v is not view] or candidates), False

    async def _attempt(self, members: list[GenerateRequest], view: WorkerView, prefilled: Prefilled | None,
                       streamed: dict[str, list[int]]) -> AsyncIterator[TokenDelta]:
        """One attempt of `members` on one decode worker."""
        for m in members:
            self.active[m.request_id].append(view.name)
        view.in_flight += 1
        try:
            make, forks = self._call(members, prefilled, streamed)
            async for d in self._stream(self.clients[view.name], members[0].request_id, make, forks):
                yield d
        finally:
            view.in_flight -= 1

    @staticmethod
    def _call(members: list[GenerateRequest], prefilled: Prefilled | None, streamed: dict[str, list[int]]
              ) -> tuple[Callable[..., GenerateCall | DecodeCall], tuple[Fork, ...]]:
        """What an attempt asks of its worker: continue the handoff into every member, resume a
        failover from the tokens already streamed (a member alone by then), or compute the prompt
        there once. The call lacks its stream (sink, key: `_stream` opens them) and comes with its forks."""
        lead, rest = members[0], members[1:]
        if prefilled is not None:
            first = {rid: d.token_ids[0] for rid, d in prefilled.firsts.items() if d.token_ids}
            return (partial(DecodeCall, lead.request_id, lead.prompt_token_ids, lead.sampling, prefilled.result.handle,
                            sent_at=time.time(), first_token=first[lead.request_id]),
                    tuple(Fork(m.request_id, m.sampling, first[m.request_id]) for m in rest))
        done = tuple(streamed[lead.request_id])
        if done:
            left = replace(lead.sampling, max_tokens=max(1, lead.sampling.max_tokens - len(done)), prompt_logprobs=None)
            return partial(GenerateCall, lead.request_id, (*lead.prompt_token_ids, *done), left,
                           resume_samples=len(done)), ()
        return (partial(GenerateCall, lead.request_id, lead.prompt_token_ids, lead.sampling),
                tuple(Fork(m.request_id, m.sampling) for m in rest))

    def _release_lease(self, prefill_worker: str, request_id: str) -> None:
        workers = self.active.get(request_id, [])
        if prefill_worker in workers:
            workers.remove(prefill_worker)
        asyncio.ensure_future(_quietly(self.clients[prefill_worker].abort(request_id)))

    async def shutdown(self) -> None:
        """End every stream now with `ShuttingDown` (the server answers UNAVAILABLE): the workers
        abort them as their attempts end; new requests are refused."""
        self.closing = True
        self._routable_changed.set()
        for q in list(self.receiver.queues.values()):
            q.push(ShuttingDown("the server is shutting down; retry on another replica"))

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

    async def _watch(self, call, queue) -> None:
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
