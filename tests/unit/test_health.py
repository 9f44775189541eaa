"""The health model's policy: liveness and progress, not latency (router/health.py)."""
import asyncio
import time

import pytest

from cluster.worker_messages import StatsSource, WorkerStats
from router.health import Change, Liveness, WorkerHealth, is_actor_death


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _stats(inc="a", ready=True, steps=0, has_work=False, **load):
    return WorkerStats(name="d0", role="decode", incarnation=inc, ready=ready, steps=steps, has_work=has_work, **load)


def test_a_worker_is_ready_only_once_it_says_so_and_a_restart_is_a_new_incarnation():
    h = WorkerHealth("w", clock=Clock())
    assert h.observe(_stats(ready=False)) is Change.NEW_INCARNATION and not h.routable   # loading / handshaking
    assert h.observe(_stats(ready=False)) is Change.NONE and not h.routable
    assert h.observe(_stats(ready=True)) is Change.NONE and h.routable
    assert h.died() is Change.DIED and h.state is Liveness.DEAD and not h.routable
    assert h.observe(_stats(inc="b", ready=False)) is Change.NEW_INCARNATION and not h.routable
    assert h.observe(_stats(inc="b", ready=True)) is Change.NONE and h.routable


def test_a_transient_death_report_with_the_same_incarnation_recovers():
    h = WorkerHealth("w", clock=Clock())
    h.observe(_stats())
    h.died()
    assert h.observe(_stats()) is Change.RECOVERED and h.routable


def test_a_busy_worker_that_makes_progress_is_never_stalled():
    clock = Clock()
    h = WorkerHealth("w", stall_s=10, clock=clock)
    h.observe(_stats())
    for i in range(100):              # long steps, always with work: slow but moving
        clock.now += 9
        assert h.observe(_stats(steps=i + 1, has_work=True)) is Change.NONE
    assert h.routable


def test_an_idle_worker_is_never_stalled():
    clock = Clock()
    h = WorkerHealth("w", stall_s=10, clock=clock)
    h.observe(_stats(steps=5))
    clock.now += 1000
    assert h.observe(_stats(steps=5, has_work=False)) is Change.NONE and h.routable


def test_work_queued_and_no_step_is_a_stall_until_it_moves_again():
    clock = Clock()
    h = WorkerHealth("w", stall_s=10, clock=clock)
    h.observe(_stats(steps=5))
    clock.now += 5
    assert h.observe(_stats(steps=5, has_work=True)) is Change.NONE      # work just arrived
    clock.now += 6
    assert h.observe(_stats(steps=5, has_work=True)) is Change.STALLED and not h.routable
    clock.now += 100
    assert h.observe(_stats(steps=5, has_work=True)) is Change.NONE and not h.routable
    assert h.observe(_stats(steps=6, has_work=True)) is Change.RECOVERED and h.routable


def test_only_rays_actor_errors_count_as_death():
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    assert is_actor_death(ActorDiedError())
    assert is_actor_death(ActorUnavailableError("restarting", None))
    assert not is_actor_death(asyncio.TimeoutError())      # slow is not dead
    assert not is_actor_death(TimeoutError())
    assert not is_actor_death(ValueError("bad request"))


@pytest.mark.parametrize("exc", [TimeoutError(), RuntimeError("engine step failed"), ValueError("bad")])
def test_the_router_keeps_routing_to_a_worker_whose_call_failed_without_dying(exc):
    from router.policy import make_policy
    from router.router import Router, RouterConfig
    from router.worker_pool import WorkerPool

    async def go():
        config = RouterConfig()
        r = Router(config, WorkerPool(config, make_policy("least_loaded"), {}, {"d0": None}), receiver=None)
        r.workers.observe(_stats(blocks_free=8, blocks_total=8), StatsSource.POLL, time.monotonic())
        assert r.views["d0"].healthy
        r.workers.worker_failed("d0", exc)
        assert r.views["d0"].healthy
        from ray.exceptions import ActorDiedError
        r.workers.worker_failed("d0", ActorDiedError())
        assert not r.views["d0"].healthy
    asyncio.run(go())


# --- the stats cadence: which workers the router polls over Ray ------------------------------------
class _Demand:
    """What `StatsCadence` reads of a router besides its pool: requests in flight."""
    def __init__(self):
        self.in_flight = 1
        self.activity = asyncio.Event()


def _pool(*names):
    """A pool of these workers (a name starting with "p": a prefill worker), as the cadence reads it."""
    from router.policy import make_policy
    from router.router import RouterConfig
    from router.worker_pool import WorkerPool
    return WorkerPool(RouterConfig(), make_policy("least_loaded"), {n: None for n in names if n.startswith("p")},
                      {n: None for n in names if not n.startswith("p")})


def _push(pool, name, at):
    """A push from `name` at `at` (monotonic), as the token stream brings it: it steps, so it has work."""
    pool.observe(_stats_of(name, running=1, has_work=True), StatsSource.PUSH, at)


def _stats_of(name, **fields):
    return WorkerStats(name=name, role="prefill" if name.startswith("p") else "decode", incarnation="a", ready=True,
                       **fields)


def test_a_worker_that_pushes_its_stats_is_not_polled_over_ray_while_its_pushes_are_fresh(monkeypatch):
    import router.stats_poll as poll_mod
    from router.stats_poll import StatsCadence
    now = [100.0]
    monkeypatch.setattr(poll_mod.time, "monotonic", lambda: now[0])
    cadence, pool, router = StatsCadence(busy_s=0.25, idle_s=2.0), _pool("p", "d"), _Demand()
    assert cadence.due(pool) == ["p", "d"]                         # first round: everyone
    cadence.next([], router.in_flight)                             # busy: a request in flight
    polls = {"p": 0, "d": 0}
    for _ in range(40):                                            # 10 s of 0.25 s rounds
        now[0] += 0.25
        _push(pool, "d", now[0] - 0.05)                            # d steps and pushes; p does not
        for name in cadence.due(pool):
            polls[name] += 1
    assert polls["p"] == 40                                        # stale: every round
    assert polls["d"] == 0                                         # fresh pushes: it lives, no Ray call
    waited = 0.0                                                   # its pushes stop (a long step, a stall):
    while "d" not in cadence.due(pool):                            # polled at the busy cadence again
        now[0] += 0.25
        waited += 0.25
    assert waited <= 0.5


def test_a_worker_in_a_long_step_with_this_routers_work_is_not_polled_faster(monkeypatch):
    """A prefill step of thousands of tokens runs for seconds on a CPU: a worker that pushes here
    and holds this router's work is late only because it steps, so it is polled only to hear that
    it lives; the same worker with nothing of this router's is polled at the busy cadence."""
    import router.stats_poll as poll_mod
    from router.stats_poll import StatsCadence
    now = [100.0]
    monkeypatch.setattr(poll_mod.time, "monotonic", lambda: now[0])
    cadence, pool, router = StatsCadence(busy_s=0.25, idle_s=2.0), _pool("p"), _Demand()
    pool.views["p"].in_flight = 4
    assert cadence.due(pool) == ["p"]
    cadence.next([], router.in_flight)
    _push(pool, "p", now[0])                                       # its last push: then a 6 s step
    polls = 0
    for _ in range(24):
        now[0] += 0.25
        polls += len(cadence.due(pool))
    assert polls == 3                                              # every 2 s
    pool.views["p"].in_flight = 0                                  # busy with another frontend's work
    polls = 0
    for _ in range(8):
        now[0] += 0.25
        polls += len(cadence.due(pool))
    assert polls >= 3


def test_an_idle_cluster_is_polled_at_the_idle_cadence(monkeypatch):
    import router.stats_poll as poll_mod
    from router.stats_poll import StatsCadence
    now = [100.0]
    monkeypatch.setattr(poll_mod.time, "monotonic", lambda: now[0])
    cadence, pool, router = StatsCadence(busy_s=0.25, idle_s=2.0, linger_s=5.0), _pool("d"), _Demand()
    router.in_flight = 0
    now[0] += 6.0                                                  # past the linger
    assert cadence.due(pool) == ["d"]
    assert cadence.next([_stats(has_work=False)], 0) == 2.0
    now[0] += 1.0
    assert cadence.due(pool) == []
    now[0] += 1.0
    assert cadence.due(pool) == ["d"]


def test_an_idle_worker_this_router_gave_nothing_is_polled_at_the_idle_cadence_while_others_work(monkeypatch):
    import router.stats_poll as poll_mod
    from router.stats_poll import StatsCadence
    now = [100.0]
    monkeypatch.setattr(poll_mod.time, "monotonic", lambda: now[0])
    cadence, pool, router = StatsCadence(busy_s=0.25, idle_s=2.0), _pool("p", "d"), _Demand()
    prefill_idle = WorkerStats(name="p", role="prefill", incarnation="a", ready=True)
    decode_busy = WorkerStats(name="d", role="decode", incarnation="a", ready=True, running=1, has_work=True)
    polls = {"p": 0, "d": 0}

    def rounds(n):
        for _ in range(n):
            due = cadence.due(pool)
            for name in due:
                polls[name] += 1
            for s in (prefill_idle, decode_busy):
                if s.name in due:
                    pool.observe(s, StatsSource.POLL, now[0])
            assert cadence.next(pool.latest_stats().values(), router.in_flight) == 0.25
            now[0] += 0.25
    rounds(40)                                                     # 10 s: d decodes (and never pushes), p rests
    assert polls["d"] == 40 and polls["p"] == 5                    # p: every 2 s
    pool.views["p"].in_flight = 1                                  # a prompt sent to p: the busy cadence
    polls["p"] = 0
    rounds(4)
    assert polls["p"] >= 3
