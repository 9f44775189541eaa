"""The driver's bring-up of a (re)started worker (cluster/launch/app.py): it never waits on a peer that
is down, and pairs with it once both are live. Fake worker clients: this is the policy only."""
import asyncio

from cluster.launch.app import _bring_up
from router.workers import WorkerRoster


class FakeWorker:
    def __init__(self, name, up=True):
        self.name, self.up = name, up
        self.peers: list[bytes] = []
        self.ready_as = None

    async def metadata(self):
        if not self.up:
            raise ConnectionError(f"{self.name} is restarting")
        return self.name.encode()

    async def add_peer(self, meta):
        if not self.up:
            raise ConnectionError(f"{self.name} is restarting")
        self.peers.append(meta)
        return meta.decode()

    async def set_ready(self, incarnation):
        self.ready_as = incarnation
        return True


def test_a_worker_is_ready_without_waiting_for_a_peer_that_is_down_and_pairs_with_it_later():
    workers = {"prefill-0": FakeWorker("prefill-0", up=False), "decode-0": FakeWorker("decode-0"),
               "decode-1": FakeWorker("decode-1")}
    roster = WorkerRoster(prefill=("prefill-0",), decode=("decode-0", "decode-1"))
    unpaired, metas = {}, {}

    async def go():
        # decode-0 restarted; prefill-0 is restarting too (its last poll failed: not among the live peers).
        await _bring_up("decode-0", "inc-2", workers, roster, metas, {"decode-1"}, unpaired)
        assert workers["decode-0"].ready_as == "inc-2" and unpaired["decode-0"] == {"prefill-0"}
        assert workers["decode-0"].peers == []
        # prefill-0 answers again but its call fails this time (slow or down): still unpaired.
        await _bring_up("decode-0", None, workers, roster, metas, {"prefill-0"}, unpaired)
        assert unpaired["decode-0"] == {"prefill-0"}
        workers["prefill-0"].up = True
        await _bring_up("decode-0", None, workers, roster, metas, {"prefill-0"}, unpaired)
        assert unpaired["decode-0"] == set()
        assert workers["decode-0"].peers == [b"prefill-0"] and workers["prefill-0"].peers == [b"decode-0"]
        assert workers["decode-1"].peers == []        # same role: never paired
    asyncio.run(go())


def test_the_supervisor_reads_liveness_from_the_pool_and_brings_up_a_worker_that_is_not_ready():
    """Each round of the driver's stats poll (`_Supervisor`): alive is heard from lately (polled or
    pushed, kept or not) and not failed this round; a worker answering not ready is brought up."""
    import time

    from cluster.launch.app import _Supervisor
    from cluster.worker_messages import StatsSource, WorkerStats
    from router.policy import make_policy
    from router.router_config import RouterConfig
    from router.stats_poll import PollRound
    from router.worker_pool import WorkerPool

    workers = {"prefill-0": FakeWorker("prefill-0"), "decode-0": FakeWorker("decode-0"),
               "decode-1": FakeWorker("decode-1")}
    roster = WorkerRoster(prefill=("prefill-0",), decode=("decode-0", "decode-1"))

    def stats(name, ready=True):
        return WorkerStats(name=name, role=roster.role_of(name), incarnation=f"{name}-2", ready=ready)

    async def go():
        pool = WorkerPool.of_roster(RouterConfig(), make_policy("least_loaded"), workers, roster)
        supervisor = _Supervisor(pool, workers, roster, {}, alive_s=4.0)
        now = time.monotonic()
        pool.observe(stats("prefill-0"), StatsSource.PUSH, now - 1.0)    # pushed lately: alive, not polled
        pool.observe(stats("decode-1"), StatsSource.POLL, now - 10.0)    # not heard from for 10 s
        restarted = stats("decode-0", ready=False)
        pool.observe(restarted, StatsSource.POLL, now)
        poll = PollRound(stats={"decode-0": restarted}, failed={})
        assert supervisor._alive(poll) == {"prefill-0", "decode-0"}
        assert supervisor._alive(PollRound(stats={}, failed={"prefill-0": TimeoutError()})) == {"decode-0"}
        supervisor(poll)
        await supervisor.pending["decode-0"]
        assert workers["decode-0"].ready_as == "decode-0-2"
        assert workers["decode-0"].peers == [b"prefill-0"] and "decode-1" not in supervisor.pending
    asyncio.run(go())
