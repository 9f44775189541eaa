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
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from cluster.config import derived, require, setting
from cluster.errors import RequestError, WorkerBusy, error_message
from cluster.kv.hashing import hash_prefix_blocks
from cluster.token_stream import StreamBroken, TokenReceiver
from cluster.types import FinishReason, GenerateRequest, TokenDelta, merge_deltas
from router.health import Change, WorkerHealth, is_actor_death
from router.policy import WorkerView


class ShuttingDown(RuntimeError):
    """The server is stopping: the stream ends with UNAVAILABLE, and the client may retry elsewhere."""


class NoWorker(RuntimeError):
    """No worker of a role became routable within `RouterConfig.unavailable_wait_s`."""

log = logging.getLogger(__name__)


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
    def __init__(self, config: RouterConfig, policy, prefill: dict, decode: dict, receiver: TokenReceiver,
                 metrics=None):
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

    def worker_polled(self, name: str, stats: dict) -> None:
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

    def update_stats(self, stats: dict) -> None:
        view = self.views.get(stats.get("name"))
        if view is not None:
            view.blocks_free = stats["blocks_free"]
            view.blocks_total = stats["blocks_total"]
            view.running = stats.get("running", 0)

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
            if prefilled is None:
                local = True            # no prefill worker could take it: the decode worker prefills
            else:
                firsts = prefilled[1]
                for first in firsts.values():
                    yield first
                members = [m for m in members if not firsts[m.request_id].finished]
                if not members:
                    return
        if not forks:
            stream = self._decode(req, dec, hashes, None if local else prefilled, streamed[req.request_id])
        else:
            stream = self._decode_group(members, dec, hashes, None if local else prefilled, streamed)
        async for d in stream:
            yield d

    async def _prefill(self, req: GenerateRequest, hashes, forks: tuple[GenerateRequest, ...] = ()):
        """(result, first delta of each member by id, worker name), or None when every prefill
        worker failed or was busy."""
        tried = set()
        members = (req, *forks)
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
                result = await self.clients[view.name].prefill(
                    req.request_id, list(req.prompt_token_ids), req.sampling,
                    tuple((f.request_id, f.sampling) for f in forks))
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
            firsts = {req.request_id: TokenDelta(
                req.request_id, (result.first_token,) if result.first_token >= 0 else (), result.text,
                result.finish_reason, result.logprobs, result.num_prompt_tokens, 1, result.num_cached_tokens,
                result.prompt_logprobs)}
            firsts |= {d.request_id: d for d in result.forks}
            for f in forks:       # ended with the request before its first token (an abort)
                firsts.setdefault(f.request_id, TokenDelta(f.request_id, (), "", result.finish_reason or
                                                           FinishReason.ABORT, (), result.num_prompt_tokens))
            return result, firsts, view.name

    async def _decode_group(self, members: list[GenerateRequest], dec: WorkerView, hashes, prefilled,
                            streamed: dict[str, list[int]]) -> AsyncIterator[TokenDelta]:
        """The samples of one prompt in one attempt on one decode worker: the handoff (`prefilled`)
        continued into every member, or the prompt computed there once. If that attempt fails,
        each unfinished member goes on alone (`_decode`), from the tokens it has streamed."""
        lead, rest = members[0], members[1:]
        view = dec
        for m in members:
            self.active[m.request_id].append(view.name)
        view.in_flight += 1
        client = self.clients[view.name]
        done: set[str] = set()
        try:
            if prefilled is not None:
                firsts = prefilled[1]
                stream = self._stream(client, "decode", lead.request_id, list(lead.prompt_token_ids), lead.sampling,
                                      prefilled[0].handle, sent_at=time.time(),
                                      first_token=firsts[lead.request_id].token_ids[0],
                                      forks=[(m.request_id, m.sampling, firsts[m.request_id].token_ids[0])
                                             for m in rest])
            else:
                stream = self._stream(client, "generate", lead.request_id, list(lead.prompt_token_ids), lead.sampling,
                                      forks=[(m.request_id, m.sampling) for m in rest])
            async for d in stream:
                if d.finished:
                    done.add(d.request_id)
                yield d
            dec.remember(hashes)
            return
        except (asyncio.CancelledError, RequestError, ShuttingDown):
            raise
        except Exception as exc:  # noqa: BLE001 - busy or failed: each member goes on alone
            log.warning("decode worker %s failed on the samples of %s (%s)", view.name, lead.request_id,
                        error_message(exc))
            if not isinstance(exc, WorkerBusy):
                self.worker_failed(view.name, exc)
                self.recoveries += 1
            if prefilled is not None:
                self._release_lease(prefilled[2], prefilled[0].request_id)
        finally:
            view.in_flight -= 1
        left = [m for m in members if m.request_id not in done]
        candidates = await self._routable("decode")
        dec = self.policy.choose_decode(hashes, [v for v in candidates if v is not view] or candidates)
        async for d in merge_streams([self._decode(m, dec, hashes, None, streamed[m.request_id]) for m in left]):
            yield d

    async def _decode(self, req: GenerateRequest, dec: WorkerView, hashes, prefilled, streamed):
        """Attempts on decode workers until the request ends: the first continues the handoff
        (`prefilled`) or prefills locally; a later one continues from the prompt plus every token
        streamed so far, with the seeded generator resumed past them."""
        failures, busy_wait = 0, 0.02
        while True:
            view = dec
            self.active[req.request_id].append(view.name)
            view.in_flight += 1
            client = self.clients[view.name]
            try:
                if prefilled is not None:
                    stream = self._stream(client, "decode", req.request_id, list(req.prompt_token_ids),
                                          req.sampling, prefilled[0].handle, sent_at=time.time())
                elif not streamed:
                    stream = self._stream(client, "generate", req.request_id, list(req.prompt_token_ids),
                                          req.sampling)
                else:
                    left = req.sampling.max_tokens - len(streamed)
                    stream = self._stream(client, "generate", req.request_id, [*req.prompt_token_ids, *streamed],
                                          replace(req.sampling, max_tokens=max(1, left), prompt_logprobs=None),
                                          resume_samples=len(streamed))
                async for d in stream:
                    yield d
                dec.remember(hashes)
                return
            except (asyncio.CancelledError, RequestError, ShuttingDown):
                raise
            except WorkerBusy as exc:
                # The handoff was declined (its lease is released): continue from the first token on
                # another decode worker, or on this one once it has room.
                self.busy_retries += 1
                log.info("decode worker %s declined %s (%s)", view.name, req.request_id, error_message(exc))
                prefilled = None
                others = [v for v in self._healthy("decode") if v is not view and v.blocks_free > 0]
                if others:
                    dec = self.policy.choose_decode(hashes, others)
                else:
                    await asyncio.sleep(busy_wait)
                    busy_wait = min(1.0, busy_wait * 2)
                    dec = self.policy.choose_decode(hashes, await self._routable("decode"))
            except Exception as exc:  # noqa: BLE001 - the worker's fault: continue elsewhere
                log.warning("decode worker %s failed on %s (%s)", view.name, req.request_id, error_message(exc))
                self.worker_failed(view.name, exc)
                self.recoveries += 1
                failures += 1
                if prefilled is not None:   # the producer's pins are no use now: release them at once
                    self._release_lease(prefilled[2], req.request_id)
                    prefilled = None
                if failures >= self.config.max_attempts:
                    raise
                candidates = await self._routable("decode")
                dec = self.policy.choose_decode(hashes, [v for v in candidates if v is not view] or candidates)
            finally:
                view.in_flight -= 1

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

    async def _stream(self, client, method: str, request_id: str, *args, forks=(), **kwargs
                      ) -> AsyncIterator[TokenDelta]:
        """One attempt on one worker: start it with a control call, read its deltas from the token
        stream. Several deltas that arrived together leave as one (a lagging reader coalesces).
        `forks`: more samples of the prompt in the same call (their arguments, to which each one's
        stream key is added); the attempt ends when every one has finished."""
        key, queue = self.receiver.open(request_id)
        keys = [key]
        for f in forks:
            keys.append(self.receiver.open(f[0], queue)[0])
        if forks:
            kwargs["forks"] = tuple((*f, k) for f, k in zip(forks, keys[1:]))
        call = client.start(method, request_id, *args, self.receiver.address, key, **kwargs)
        watch = asyncio.ensure_future(self._watch(call, queue))
        running = 1 + len(forks)
        try:
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
