"""Orchestrates one request: pick workers, prefill (or not), hand the KV to decode, stream tokens.

A handed-off request is one Ray call, to the prefill worker, naming the decode worker: the prefill
worker streams the first token as soon as its prefill ends, before the decode worker has pulled
the KV, and starts the decode itself (`Attempts.handoff`). The router keeps the request registry (which workers hold each request, whose tenant
owns it, what each member has streamed) and the top-level flow (`Router.generate`: register,
choose, prefill here or there, decode, forget); the calls on workers and their failover are
`router/attempts.py`, the workers' health and routing views `router/worker_pool.py`.

Whose fault an error is decides what happens (`cluster/errors.py`): a `RequestError` goes to the
client and leaves the worker in routing; `WorkerBusy` (no room for a handoff) continues the
request on another worker, or on the same one once it has room; only a dead worker (Ray says so)
leaves routing, until its new incarnation is back (`router/health.py`). Requests wait, within their
deadline, for a worker to route to: before the cluster is ready, and while every worker of a role
is restarting.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from enum import Enum

from cluster.errors import RequestError
from cluster.kv.hashing import hash_prefix_blocks
from cluster.token_stream import TokenReceiver
from cluster.types import GenerateRequest, TokenDelta
from cluster.worker_messages import StatsSource, stats_from_wire
from router.admission import SHUTTING_DOWN
from router.attempts import Attempts, NoPrefillTaken
from router.health import WorkerHealth
from router.policy import WorkerView
from router.prefix_fetch import FetchPlan, plan_fetch
from router.router_config import RouterConfig
from router.worker_pool import NoWorker, ShuttingDown, WorkerPool

__all__ = ["NoWorker", "PrefillPlace", "Router", "RouterConfig", "ShuttingDown"]   # RouterConfig: the wiring's


class PrefillPlace(Enum):
    """Where a prompt is prefilled, and why (`splitserve_prefills_total{place}`): a disaggregated
    cluster that moved no KV says which rule kept its prompts on the decode worker."""
    HANDOFF = "handoff"                      # on a prefill worker; its KV moved to the decode worker
    SHORT = "short"                          # within --local-prefill-max-tokens: on the decode worker
    CACHED = "cached"                        # mostly cached on the decode worker already
    FETCHED = "fetched"                      # mostly cached on another worker: pulled from it (prefix_fetch.py)
    COLOCATED = "colocated"                  # every worker runs both phases
    NO_PREFILL_WORKER = "no_prefill_worker"  # none routable, or none could take it: the decode worker


class Router:
    def __init__(self, config: RouterConfig, workers: WorkerPool, receiver: TokenReceiver, metrics=None,
                 model_slot: Callable[[], AbstractAsyncContextManager] | None = None):
        """`workers`: the pool of this router's workers (`WorkerPool.of_roster`, router/frontend.py);
        the workers' pushed stats reach it through `receiver`. `model_slot`: --max-loaded-models'
        place for one request while it runs (router/model_swap.py: its model loaded and let in)."""
        self.config = config
        self.receiver = receiver
        self.metrics = metrics
        self.workers = workers
        self.in_flight = 0
        self.activity = asyncio.Event()          # set by each new request: wakes an idle stats poll
        if receiver is not None:
            receiver.on_stats = self.stats_pushed
        self.active: dict[str, list[str]] = {}   # request id -> workers holding it
        self.owner: dict[str, str] = {}          # request id -> its tenant (only it may abort it)
        self.attempts = Attempts(config, self.workers, receiver, self.active, metrics)
        self.model_slot = model_slot or nullcontext

    # --- the workers, as the frontend, the stats poll and the servers see them -----------------
    @property
    def ready(self) -> bool:
        """Every worker has loaded and been handshaken at least once (gRPC health: SERVING)."""
        return self.workers.ready

    @property
    def closing(self) -> bool:
        return self.workers.closed

    @property
    def views(self) -> dict[str, WorkerView]:
        return self.workers.views

    @property
    def health(self) -> dict[str, WorkerHealth]:
        return self.workers.health

    @property
    def recoveries(self) -> int:
        """Streams continued on another worker after a failure."""
        return self.attempts.recoveries

    @property
    def busy_retries(self) -> int:
        """Handoffs a full decode worker declined."""
        return self.attempts.busy_retries

    @property
    def worker_calls(self) -> int:
        """Ray calls this router made on workers for requests (data calls and aborts; not the
        stats poll's): a handed-off request that streams to its end costs one."""
        return self.attempts.worker_calls

    def stats_pushed(self, worker: str, body: dict) -> None:
        """Stats a worker pushed over its token stream (cluster/token_stream.py), observed by the pool
        as a poll's are (a worker this frontend does not route is ignored there). ValueError (the
        frame is refused) for a body this version does not read, or stats that name another worker
        than the connection's."""
        stats = stats_from_wire(body)
        if stats.name != worker:
            raise ValueError(f"stats of {stats.name!r} from the connection of {worker!r}")
        self.workers.observe(stats, StatsSource.PUSH, time.monotonic())

    async def routing_changed(self) -> None:
        """Returns at the next change of any worker's routability."""
        await self.workers.routing_changed()

    # --- requests -------------------------------------------------------------------------------
    def check_capacity(self, req: GenerateRequest) -> None:
        """Refuse, before anything is scheduled, a prompt no decode worker can ever hold (its KV
        plus the first generated token), naming the numbers."""
        largest = self.workers.largest_decode_pool()
        if largest is None:
            return
        need = -(-(len(req.prompt_token_ids) + 1) // self.config.block_size)
        if need > largest:
            raise RequestError(f"prompt: {len(req.prompt_token_ids)} tokens need {need} KV blocks of "
                               f"{self.config.block_size} tokens, but the largest decode worker holds {largest}; "
                               "shorten the prompt", "INVALID_ARGUMENT")

    async def abort(self, request_id: str, tenant: str | None = None) -> bool:
        """Stop a request everywhere. With `tenant`, only the owner's: another's is an unknown id."""
        if tenant is not None and self.owner.get(request_id, tenant) != tenant:
            return False
        workers = self.active.get(request_id, [])
        await asyncio.gather(*(self.attempts.abort_on(w, request_id) for w in workers), return_exceptions=True)
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
            raise ShuttingDown(SHUTTING_DOWN)
        self.in_flight += len(members)
        self.activity.set()
        streamed: dict[str, list[int]] = {}
        for m in members:
            self.active[m.request_id] = []
            self.owner[m.request_id] = m.tenant
            streamed[m.request_id] = []
        try:
            async with self.model_slot():
                try:
                    async for delta in self._generate(req, forks, streamed):
                        streamed[delta.request_id].extend(delta.token_ids)
                        if delta.finished:
                            self.active[delta.request_id] = []    # finished normally: nothing to abort
                        yield delta
                finally:     # ended everywhere before its model's slot frees (its weights may go)
                    await asyncio.shield(self._end([m.request_id for m in members]))
        finally:
            self.in_flight -= len(members)
            # One shielded task ends them all: a caller cancelled again while it waits (anyio's
            # cancel scopes re-cancel at every await) must not leave a member running. Not a plain
            # forget after the inner end: that end's task starts at the loop's next turn, and must
            # still find the members active to abort them.
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
        """Choose the decode worker, then hand the request off through a prefill worker unless the
        prompt is not worth it (the first tokens stream as its prefill ends), else decode there."""
        self.check_capacity(req)
        hashes = hash_prefix_blocks(req.prompt_token_ids, self.config.block_size, req.sampling.cache_salt)
        dec = self.workers.policy.choose_decode(hashes, await self.workers.routable("decode"))
        prefix = None
        members = [req, *forks]
        place = self._prefill_place(req, hashes, dec)
        fetch = self._fetch_plan(hashes, dec) if place is PrefillPlace.HANDOFF else None
        if fetch is not None:
            prefix = await self.attempts.export_prefix(req, fetch)
            place = PrefillPlace.FETCHED if prefix is not None else place
        if place is PrefillPlace.HANDOFF:
            handoff = self.attempts.handoff(members, dec, hashes, streamed)
            try:
                first = await anext(handoff)
            except NoPrefillTaken:       # no prefill worker could take it; the decode worker prefills
                place = PrefillPlace.NO_PREFILL_WORKER
            else:
                self._count(place)
                yield first
                async for d in handoff:
                    yield d
                return
            finally:
                await handoff.aclose()
        self._count(place)
        async for d in self.attempts.decode(members, dec, hashes, None, streamed, prefix):
            yield d

    def _count(self, place: PrefillPlace) -> None:
        if self.metrics is not None:
            self.metrics.count_prefill(place.value)

    def _fetch_plan(self, hashes, dec: WorkerView) -> FetchPlan | None:
        """A prefill worker holding most of the prompt, if pulling from it beats computing (prefix_fetch.py)."""
        return plan_fetch(hashes, dec, self.workers.healthy("prefill"), self.workers.latest_stats(),
                          self.config.block_size, self.config.local_prefill_cached_fraction, self.config.prefix_fetch)

    def _prefill_place(self, req: GenerateRequest, hashes, dec: WorkerView) -> PrefillPlace:
        """Conditional disaggregation: on the decode worker when colocated, for a short prompt, one
        mostly cached there already, or with no prefill worker to route to; else a handoff."""
        cfg = self.config
        if cfg.colocated:
            return PrefillPlace.COLOCATED
        if len(req.prompt_token_ids) <= cfg.local_prefill_max_tokens:
            return PrefillPlace.SHORT
        if hashes and dec.cached_prefix(hashes) >= cfg.local_prefill_cached_fraction * len(hashes):
            return PrefillPlace.CACHED
        if not self.workers.healthy("prefill"):
            return PrefillPlace.NO_PREFILL_WORKER
        return PrefillPlace.HANDOFF

    async def shutdown(self) -> None:
        """End every stream now with `ShuttingDown` (the server answers UNAVAILABLE): the workers
        abort them as their attempts end; new requests are refused."""
        self.workers.close()
        for q in list(self.receiver.queues.values()):
            q.push(ShuttingDown(SHUTTING_DOWN))

