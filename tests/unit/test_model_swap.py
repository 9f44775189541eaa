"""--max-loaded-models' dispatch order (router/model_swap.py): the policy's plain functions, and the
gate that applies it, with fake loaders (what a load is on real workers: tests/e2e/test_model_swap_cluster.py)."""
import asyncio

from router.model_swap import (
    ModelScheduling,
    ModelSwapGate,
    Waiting,
    idle_victim,
    next_step,
)

FCFS, GROUPED = ModelScheduling.FCFS, ModelScheduling.GROUPED


def _w(*models, at=0.0):
    return [Waiting(m, at + i * 0.001) for i, m in enumerate(models)]


def test_fcfs_stops_at_the_first_request_of_an_unloaded_model():
    step = next_step(_w("a", "b", "a"), ["a"], {"a": 1}, 1, FCFS, now=0.1, max_wait_s=5)
    assert step.admit == (0,) and step.load is None     # "a" runs: no idle slot for "b" yet
    step = next_step(_w("b", "a"), ["a"], {}, 1, FCFS, now=0.1, max_wait_s=5)
    assert step.admit == () and (step.load, step.evict) == ("b", "a")
    step = next_step(_w("a", "b"), ["a"], {}, 1, FCFS, now=0.1, max_wait_s=5)
    assert step.admit == (0,) and step.load is None      # "a" was just let in: it is not idle


def test_grouped_serves_the_loaded_model_then_the_largest_group():
    waiting = _w("b", "a", "c", "c", "a")
    step = next_step(waiting, ["a"], {}, 1, GROUPED, now=0.1, max_wait_s=5)
    assert step.admit == (1, 4) and step.load is None    # "a" now runs: no idle slot
    step = next_step(_w("b", "c", "c"), ["a"], {}, 1, GROUPED, now=0.1, max_wait_s=5)
    assert (step.load, step.evict) == ("c", "a")
    step = next_step(_w("b", "c"), ["a"], {}, 2, GROUPED, now=0.1, max_wait_s=5)
    assert (step.load, step.evict) == ("b", None)        # a free slot; tie: the oldest's model


def test_grouped_fairness_bound_stops_letting_loaded_models_in():
    waiting = _w("b", "a")
    step = next_step(waiting, ["a"], {"a": 2}, 1, GROUPED, now=10.0, max_wait_s=5)
    assert step.admit == () and step.load is None     # "a" lets nobody more in, and drains
    step = next_step(waiting, ["a"], {}, 1, GROUPED, now=10.0, max_wait_s=5)
    assert (step.load, step.evict) == ("b", "a")
    # Both overdue, the loaded model's request the older: it goes first (no swapping back and forth).
    step = next_step(_w("a", "b", "a"), ["a"], {}, 1, GROUPED, now=10.0, max_wait_s=5)
    assert step.admit == (0,) and step.load is None


def test_idle_victim_is_the_least_recently_used_idle_model():
    assert idle_victim(["a", "b", "c"], {"a": 1}) == "b"
    assert idle_victim(["a"], {"a": 1}) is None


class _FakeLoader:
    def __init__(self, name, log):
        self.name, self.log = name, log

    async def load(self):
        await asyncio.sleep(0.01)
        self.log.append(("load", self.name))

    async def unload(self):
        self.log.append(("unload", self.name))


async def _run(scheduling, arrivals, capacity=1, max_wait_s=5.0):
    log, order = [], []
    gate = ModelSwapGate(capacity, scheduling, max_wait_s)
    for m in ("a", "b"):
        gate.register(m, _FakeLoader(m, log))
    await gate.trim()

    async def request(i, model):
        async with gate.serving(model):
            order.append((i, model))
            await asyncio.sleep(0.005)
    await asyncio.gather(*(request(i, m) for i, m in enumerate(arrivals)))
    return gate, log, order


def test_gate_grouped_loads_less_than_fcfs_and_ends_idle():
    arrivals = ["a", "b", "a", "b", "a", "b"]
    fcfs, _, fcfs_order = asyncio.run(_run(FCFS, arrivals))
    grouped, log, order = asyncio.run(_run(GROUPED, arrivals))
    assert [m for _, m in fcfs_order] == arrivals            # arrival order kept
    assert sum(grouped.loads.values()) == 1 < sum(fcfs.loads.values()) == 5
    assert [m for _, m in order] == ["a", "a", "a", "b", "b", "b"]
    assert log[0] == ("unload", "b") and ("unload", "a") in log     # trim, then the switch
    for gate in (fcfs, grouped):
        assert not any(gate.running.values()) and not gate._waiters and len(gate.loaded) == 1


def test_gate_fairness_bound_lets_an_overdue_model_in():
    async def scenario():
        gate = ModelSwapGate(1, GROUPED, max_wait_s=0.05)
        log = []
        for m in ("a", "b"):
            gate.register(m, _FakeLoader(m, log))
        await gate.trim()
        served = []

        async def stream_of(model, n):     # a client that keeps its model busy
            for _ in range(n):
                async with gate.serving(model):
                    served.append(model)
                    await asyncio.sleep(0.01)

        async def one_b():
            await asyncio.sleep(0.005)
            async with gate.serving("b"):
                served.append("b")
        await asyncio.gather(stream_of("a", 40), stream_of("a", 40), one_b())
        return served
    served = asyncio.run(scenario())
    assert "b" in served[:20]      # not after every "a": about max_wait_s in, "b" went


def test_gate_forgets_a_request_cancelled_while_waiting():
    async def scenario():
        log = []
        gate = ModelSwapGate(1, GROUPED, max_wait_s=5.0)
        for m in ("a", "b"):
            gate.register(m, _FakeLoader(m, log))
        await gate.trim()
        release = asyncio.Event()

        async def hold_a():
            async with gate.serving("a"):
                await release.wait()

        async def want_b():
            async with gate.serving("b"):
                pass
        holder = asyncio.ensure_future(hold_a())
        await asyncio.sleep(0)
        waiter = asyncio.ensure_future(want_b())
        await asyncio.sleep(0.01)
        assert [w.waiting.model for w in gate._waiters] == ["b"]    # "a" runs: "b" waits
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        release.set()
        await holder
        await asyncio.sleep(0.03)
        return gate, log
    gate, log = asyncio.run(scenario())
    assert not gate._waiters and not any(gate.running.values())
    assert gate.loaded == ["a"] and ("load", "b") not in log      # nobody wants "b" any more
