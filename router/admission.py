"""Who gets an in-flight slot: a bounded, tenant-fair share of the frontend's requests.

Every sample of a request (OpenAI's prompts x n; one for gRPC) takes a slot from the moment it is
admitted until its stream ends. A request is admitted at once when its slots are free and nobody
waits; otherwise it waits in a bounded queue, for at most `queue_timeout_s`, and then gets 429 /
RESOURCE_EXHAUSTED. When slots free up they go to the waiting tenant that holds the fewest (its
oldest request first): a tenant that floods the server waits behind every quieter tenant, never
the other way round. A tenant may also be capped outright (`max_in_flight_per_tenant`).

Admission comes before the expensive work (tokenization, template rendering): a request that
cannot be admitted costs only its body's parse.
"""
from __future__ import annotations

import asyncio
import enum
import time
from collections import Counter
from dataclasses import dataclass

from cluster.config import require, setting


SHUTTING_DOWN = "the server is shutting down; retry on another replica"


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int = setting(256, "in-flight slots of one frontend, one per sample of a request (vLLM: "
                                      "--max-num-seqs is the engine's)")
    max_in_flight_per_tenant: int | None = setting(None, "the most slots one tenant may hold",
                                                   default_text="every slot nobody else waits for")
    max_queued: int = setting(256, "requests waiting for slots; beyond this, refused at once (429)")
    queue_timeout_s: float = setting(30.0, "how long a request waits for slots before 429")

    def __post_init__(self) -> None:
        require(self.max_in_flight >= 1, "max_in_flight", f"must be >= 1, got {self.max_in_flight}")
        cap = self.max_in_flight_per_tenant
        require(cap is None or cap >= 1, "max_in_flight_per_tenant", f"must be >= 1, got {cap}")
        require(self.max_queued >= 0, "max_queued", f"must be >= 0, got {self.max_queued}")
        require(self.queue_timeout_s > 0, "queue_timeout_s", f"must be > 0, got {self.queue_timeout_s}")


class RefusedWhy(enum.Enum):
    TOO_LARGE = "too_large"          # more slots than it could ever get (a 400: the client must change it)
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    SHUTTING_DOWN = "shutting_down"

    # How both APIs answer a refusal (router/server.py, router/openai/http_server.py): the client's own
    # request too large to ever fit, the server stopping, or busy (retry later).
    @property
    def grpc_code(self) -> str:
        return "UNAVAILABLE" if self is RefusedWhy.SHUTTING_DOWN else "RESOURCE_EXHAUSTED"

    @property
    def http_status(self) -> int:
        return {RefusedWhy.TOO_LARGE: 400, RefusedWhy.SHUTTING_DOWN: 503}.get(self, 429)


class Refused(Exception):
    def __init__(self, why: RefusedWhy, message: str):
        super().__init__(message)
        self.why = why


@dataclass(frozen=True)
class Ticket:
    """Slots held by one request; give them back with `Admission.release` exactly once."""
    tenant: str
    slots: int


class _Waiter:
    __slots__ = ("tenant", "slots", "future", "since")

    def __init__(self, tenant: str, slots: int, future: asyncio.Future):
        self.tenant, self.slots, self.future, self.since = tenant, slots, future, time.monotonic()


class Admission:
    def __init__(self, cfg: AdmissionConfig, metrics=None, tenants: tuple[str, ...] = ()):
        """`metrics`: the frontend's `ClusterMetrics` (refusals, queue depth per tenant). `tenants`:
        those known in advance (the API keys'; "" without keys), whose queue depth reads 0 from the
        start rather than appearing with their first wait."""
        self.cfg = cfg
        self.metrics = metrics
        self.in_use = 0
        self.by_tenant: Counter[str] = Counter()
        self.waiting: list[_Waiter] = []
        self.closed = False
        self._none_held = asyncio.Event()    # no slot held: what a draining server waits for
        self._none_held.set()
        for tenant in tenants:
            self._gauge(tenant)

    @property
    def tenant_cap(self) -> int:
        cap = self.cfg.max_in_flight_per_tenant
        return self.cfg.max_in_flight if cap is None else min(cap, self.cfg.max_in_flight)

    def _fits(self, tenant: str, slots: int) -> bool:
        return self.in_use + slots <= self.cfg.max_in_flight and self.by_tenant[tenant] + slots <= self.tenant_cap

    async def admit(self, tenant: str, slots: int, closing: bool) -> Ticket:
        """The one admission check of both APIs: refused while the router is `closing` (shutting
        down), else `acquire`. Raises `Refused`; each API answers it by `why`."""
        if closing:
            raise self._refuse(tenant, RefusedWhy.SHUTTING_DOWN, SHUTTING_DOWN)
        return await self.acquire(tenant, slots)

    async def acquire(self, tenant: str, slots: int) -> Ticket:
        """Slots for one request, now or after a wait in the fair queue; raises `Refused`."""
        if self.closed:
            raise self._refuse(tenant, RefusedWhy.SHUTTING_DOWN, SHUTTING_DOWN)
        if slots > self.tenant_cap:
            raise self._refuse(tenant, RefusedWhy.TOO_LARGE,
                               f"this request needs {slots} in-flight slots (one per prompt and sample) but the server "
                               f"gives a tenant at most {self.tenant_cap} (--max-in-flight"
                               f"{'-per-tenant' if self.tenant_cap < self.cfg.max_in_flight else ''}); split it")
        if not self.waiting and self._fits(tenant, slots):
            return self._grant(tenant, slots)
        if len(self.waiting) >= self.cfg.max_queued or self.cfg.queue_timeout_s <= 0:
            raise self._refuse(tenant, RefusedWhy.QUEUE_FULL,
                               f"the server is at its limit of {self.cfg.max_in_flight} requests in flight and "
                               f"{len(self.waiting)} waiting; retry later")
        waiter = _Waiter(tenant, slots, asyncio.get_running_loop().create_future())
        self.waiting.append(waiter)
        self._gauge(tenant)
        try:
            # shield: a timeout or a cancelled client must not cancel a grant that just happened
            async with asyncio.timeout(self.cfg.queue_timeout_s):
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            self._abandon(waiter)
            raise self._refuse(tenant, RefusedWhy.QUEUE_TIMEOUT,
                               f"no in-flight slot freed up within {self.cfg.queue_timeout_s:g}s (the server is at "
                               f"its limit of {self.cfg.max_in_flight}); retry later") from None
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter that stops waiting: out of the queue, or, if it was granted meanwhile, its slots back."""
        if waiter.future.done():
            if not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result())
        else:
            waiter.future.cancel()
            self.waiting.remove(waiter)
            self._gauge(waiter.tenant)

    def close(self) -> None:
        """Shutting down: waiters are refused, and so is every later request."""
        self.closed = True
        waited = {w.tenant for w in self.waiting}
        for w in list(self.waiting):
            w.future.set_exception(Refused(RefusedWhy.SHUTTING_DOWN, "the server is shutting down"))
        self.waiting.clear()
        for tenant in waited:
            self._gauge(tenant)

    def _refuse(self, tenant: str, why: RefusedWhy, message: str) -> Refused:
        if self.metrics is not None:
            self.metrics.count_refused(why.value, tenant)
        return Refused(why, message)

    def _gauge(self, tenant: str) -> None:
        """The queue depth of `tenant`, after its waiters changed."""
        if self.metrics is not None:
            self.metrics.set_admission_queue_depth(tenant, sum(w.tenant == tenant for w in self.waiting))

    def _grant(self, tenant: str, slots: int) -> Ticket:
        self._none_held.clear()
        self.in_use += slots
        self.by_tenant[tenant] += slots
        return Ticket(tenant, slots)

    def release(self, ticket: Ticket) -> None:
        self.in_use -= ticket.slots
        self.by_tenant[ticket.tenant] -= ticket.slots
        if self.by_tenant[ticket.tenant] <= 0:
            del self.by_tenant[ticket.tenant]
        self._wake()
        if self.in_use == 0:
            self._none_held.set()

    async def wait_none_held(self, timeout_s: float) -> bool:
        """Wait until every admitted request has ended (its slots released); False if some still
        run after `timeout_s`."""
        if self._none_held.is_set():
            return True
        try:
            await asyncio.wait_for(self._none_held.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _wake(self) -> None:
        """Grant waiting requests while any fits: the tenant holding fewest slots first, then the oldest."""
        while self.waiting:
            fitting = [w for w in self.waiting if self._fits(w.tenant, w.slots)]
            if not fitting:
                return
            w = min(fitting, key=lambda w: (self.by_tenant[w.tenant], w.since))
            self.waiting.remove(w)
            self._gauge(w.tenant)
            w.future.set_result(self._grant(w.tenant, w.slots))
