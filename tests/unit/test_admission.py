"""Admission's policy and the validation pool's: slots are never over-granted or lost, a flooding tenant waits behind a quiet
one, the queue is bounded in length and in time, and a waiter that leaves gives back what it was
granted (asyncio, no cluster: this is the policy alone)."""
from __future__ import annotations

import asyncio

import pytest

import os
import threading

from router.admission import Admission, AdmissionConfig, Refused, RefusedWhy
from router.offload import NICE, Offload


def _run(coro):
    return asyncio.run(coro)


async def _refused(attempt, why: RefusedWhy) -> Refused:
    with pytest.raises(Refused) as e:
        await attempt
    assert e.value.why is why, e.value
    return e.value


async def _settle():
    for _ in range(5):          # a grant reaches its waiter through a few callbacks
        await asyncio.sleep(0)


def test_fair_queue_serves_the_quiet_tenant_before_the_flooder():
    async def go():
        a = Admission(AdmissionConfig(max_in_flight=4, queue_timeout_s=5))
        held = [await a.acquire("flood", 1) for _ in range(4)]
        order = []

        async def wait(tenant):
            t = await a.acquire(tenant, 1)
            order.append(tenant)
            return t
        flood = [asyncio.ensure_future(wait("flood")) for _ in range(3)]
        await asyncio.sleep(0)
        quiet = asyncio.ensure_future(wait("quiet"))       # arrives last
        await asyncio.sleep(0)
        assert len(a.waiting) == 4
        a.release(held.pop())
        await _settle()
        assert order == ["quiet"]                        # holds 0 slots: it goes first
        for t in held:
            a.release(t)
        tickets = await asyncio.gather(*flood, quiet)
        for t in tickets:
            a.release(t)
        assert a.in_use == 0 and not a.by_tenant and not a.waiting
    _run(go())


def test_a_drain_refuses_new_and_queued_requests_and_waits_for_those_admitted():
    """What a SIGTERM'd server waits for: every admitted request's slots back, whatever their
    order; waiters and newcomers are refused as shutting down."""
    async def go():
        a = Admission(AdmissionConfig(max_in_flight=2, queue_timeout_s=5))
        assert await a.wait_none_held(0)                 # nothing admitted: drained at once
        held = [await a.acquire("t", 1) for _ in range(2)]
        queued = asyncio.ensure_future(a.acquire("u", 1))
        await asyncio.sleep(0)
        a.close()
        await _refused(queued, RefusedWhy.SHUTTING_DOWN)
        await _refused(a.admit("u", 1, closing=False), RefusedWhy.SHUTTING_DOWN)
        assert not await a.wait_none_held(0.05)          # two still run
        a.release(held.pop())
        assert not await a.wait_none_held(0.05)
        waiting = asyncio.ensure_future(a.wait_none_held(5))
        await asyncio.sleep(0)
        a.release(held.pop())
        assert await waiting and a.in_use == 0
    _run(go())


def test_queue_bounds_timeouts_and_too_large():
    async def go():
        a = Admission(AdmissionConfig(max_in_flight=2, max_queued=1, queue_timeout_s=0.05,
                                      max_in_flight_per_tenant=2))
        t = await a.acquire("x", 2)
        assert "--max-in-flight" in str(await _refused(a.acquire("x", 3), RefusedWhy.TOO_LARGE))
        waiter = asyncio.ensure_future(a.acquire("y", 1))
        await asyncio.sleep(0)
        await _refused(a.acquire("z", 1), RefusedWhy.QUEUE_FULL)
        await _refused(waiter, RefusedWhy.QUEUE_TIMEOUT)
        a.release(t)
        assert a.in_use == 0 and not a.waiting
    _run(go())


def test_per_tenant_cap_leaves_room_for_others():
    async def go():
        a = Admission(AdmissionConfig(max_in_flight=4, max_in_flight_per_tenant=2, queue_timeout_s=0.05))
        mine = [await a.acquire("big", 1), await a.acquire("big", 1)]
        await _refused(a.acquire("big", 1), RefusedWhy.QUEUE_TIMEOUT)   # over its cap: waits, then times out
        other = await a.acquire("small", 2)               # the rest is still there for others
        for t in (*mine, other):
            a.release(t)
        assert a.in_use == 0
    _run(go())


def test_a_cancelled_waiter_leaves_nothing_behind_even_if_granted_meanwhile():
    async def go():
        a = Admission(AdmissionConfig(max_in_flight=1, queue_timeout_s=5))
        t = await a.acquire("x", 1)
        waiter = asyncio.ensure_future(a.acquire("y", 1))
        await asyncio.sleep(0)
        a.release(t)                 # grants the waiter ...
        waiter.cancel()              # ... which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert a.in_use == 0 and not a.waiting and not a.by_tenant
        t = await a.acquire("x", 1)
        queued = asyncio.ensure_future(a.acquire("z", 1))
        await asyncio.sleep(0)
        a.close()                    # shutting down: the waiter is refused, and so is what comes later
        for attempt in (queued, a.acquire("z", 1)):
            await _refused(attempt, RefusedWhy.SHUTTING_DOWN)
        a.release(t)
        assert a.in_use == 0 and not a.waiting
    _run(go())


def test_queue_depth_and_refusals_are_counted_per_tenant():
    from cluster.metrics import ClusterMetrics

    def depth(m, tenant):
        return m.queued.labels(model_name="m", tenant=tenant)._value.get()

    async def go():
        m = ClusterMetrics("tcp", "m")
        a = Admission(AdmissionConfig(max_in_flight=2, max_queued=3, queue_timeout_s=5), m, tenants=("", "quiet"))
        assert depth(m, "anonymous") == depth(m, "quiet") == 0          # known tenants read 0 from the start
        held, flooding = await a.acquire("", 1), await a.acquire("flood", 1)
        flood = [asyncio.ensure_future(a.acquire("flood", 1)) for _ in range(2)]
        quiet = asyncio.ensure_future(a.acquire("quiet", 1))
        await asyncio.sleep(0)
        assert (depth(m, "flood"), depth(m, "quiet"), depth(m, "anonymous")) == (2, 1, 0)
        await _refused(a.acquire("", 1), RefusedWhy.QUEUE_FULL)
        assert m.refused.labels(model_name="m", reason="queue_full", tenant="anonymous")._value.get() == 1
        a.release(held)
        t = await quiet                                  # holds none, the flooder one: quiet first
        assert (depth(m, "flood"), depth(m, "quiet")) == (2, 0)
        a.close()
        for f in flood:
            await _refused(f, RefusedWhy.SHUTTING_DOWN)
        assert depth(m, "flood") == 0
        a.release(t)
        a.release(flooding)
    _run(go())


def test_validation_pool_runs_a_tenant_one_job_at_a_time_below_serving_priority():
    async def go():
        pool = Offload(threads=2, max_pending=3)
        release = threading.Event()
        running: list[str] = []

        def job(name):
            running.append(name)
            release.wait(5)
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        first = asyncio.ensure_future(pool.run("flood", job, "flood-1"))
        second = asyncio.ensure_future(pool.run("flood", job, "flood-2"))
        quiet = asyncio.ensure_future(pool.run("quiet", job, "quiet-1"))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(running) == 2:
                break
        assert sorted(running) == ["flood-1", "quiet-1"]      # the flood's second job waits its turn
        with pytest.raises(Refused):
            await pool.run("other", job, "x")                   # max_pending: refused, not queued
        first.cancel()                                          # its caller leaves; the thread goes on ...
        await asyncio.sleep(0.05)
        assert running == ["flood-1", "quiet-1"]                # ... and keeps the tenant's turn
        release.set()
        assert await quiet == await second == NICE
        assert pool.pending == 0 and not pool._jobs             # noqa: SLF001
        pool.close()
    _run(go())
