"""The router's choice to pull a prefix from the worker that holds it rather than compute it
(router/prefix_fetch.py): from measured bandwidth, prefill speed and tier loads, never without
them, only for a holder with most of the prompt, and the cheapest holder when several are."""
from __future__ import annotations

from cluster.kv.kv_events import KVEventLog, KVTier
from cluster.worker_messages import HandoffStats, TierStats, WorkerStats
from router.kv_index import ClusterKVIndex
from router.policy import WorkerView
from router.prefix_fetch import plan_fetch

K = [bytes([i]) * 16 for i in range(20)]
BS = 16
BLOCK_BYTES = 1 << 20            # 1 MiB a block


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _index(holdings: dict[str, tuple[int, int]]) -> ClusterKVIndex:
    """worker -> (leading blocks of K in its pool, further leading blocks in its host tier)."""
    index = ClusterKVIndex(clock=Clock())
    for name, (pool, host) in holdings.items():
        log = KVEventLog(name)
        for k in K[:pool]:
            log.stored(KVTier.POOL, k)
        for k in K[pool:pool + host]:
            log.stored(KVTier.HOST, k)
        index.apply(log.read("", 0))
    return index


def _stats(name: str, role: str, *, tokens=0, seconds=0.0, moved=0, moved_s=0.0, loaded=0, load_s=0.0):
    return WorkerStats(name, role, "i", True, blocks_total=100, kv_bytes=100 * BLOCK_BYTES,
                       prompt_tokens_computed=tokens, prompt_seconds=seconds,
                       handoff=HandoffStats(bytes=moved, seconds=moved_s) if role == "decode" else None,
                       tiers=TierStats(loaded_host=loaded, load_seconds=load_s))


def _views(index):
    return [WorkerView(n, "prefill" if n.startswith("p") else "decode", index=index) for n in ("d0", "p0", "p1")]


def test_fetch_when_the_transfer_beats_the_prefill_and_not_otherwise():
    index = _index({"d0": (0, 0), "p0": (18, 0)})
    dec, p0, p1 = _views(index)
    # 1000 prompt tokens/s (16 ms a block) against 1 GB/s (1 ms a block): 18 blocks are worth a pull.
    fast = {"d0": _stats("d0", "decode", tokens=1000, seconds=1.0, moved=10 << 30, moved_s=10.0),
            "p0": _stats("p0", "prefill", tokens=1000, seconds=1.0)}
    plan = plan_fetch(K[:20], dec, [p0, p1], fast, BS, 0.75)
    assert plan is not None and (plan.source, plan.blocks) == ("p0", 18) and plan.fetch_s < plan.compute_s
    # A network 100x slower (10 MB/s: 100 ms a block) loses to computing.
    slow = {**fast, "d0": _stats("d0", "decode", tokens=1000, seconds=1.0, moved=100 << 20, moved_s=10.0)}
    assert plan_fetch(K[:20], dec, [p0, p1], slow, BS, 0.75) is None
    assert plan_fetch(K[:20], dec, [p0, p1], slow, BS, 0.75, mode="always").source == "p0"
    assert plan_fetch(K[:20], dec, [p0, p1], fast, BS, 0.75, mode="off") is None


def test_nothing_is_fetched_without_measurements_or_a_holder_of_most_of_the_prompt():
    index = _index({"d0": (0, 0), "p0": (18, 0), "p1": (10, 0)})
    dec, p0, p1 = _views(index)
    unmeasured = {"d0": _stats("d0", "decode"), "p0": _stats("p0", "prefill")}
    assert plan_fetch(K[:20], dec, [p0, p1], unmeasured, BS, 0.75) is None
    measured = {"d0": _stats("d0", "decode", tokens=1000, seconds=1.0, moved=10 << 30, moved_s=10.0),
                "p0": _stats("p0", "prefill"), "p1": _stats("p1", "prefill")}
    assert plan_fetch(K[:20], dec, [p1], measured, BS, 0.75) is None       # 10 of 20 blocks: under 75%
    own = _index({"d0": (17, 0), "p0": (18, 0)})                            # the decode worker has nearly all
    assert plan_fetch(K[:20], _views(own)[0], [_views(own)[1]], measured, BS, 0.75) is None


def test_a_holder_whose_blocks_must_come_up_from_its_tier_costs_its_measured_load_time():
    index = _index({"d0": (0, 0), "p0": (0, 18), "p1": (16, 0)})
    dec, p0, p1 = _views(index)
    base = {"d0": _stats("d0", "decode", tokens=1000, seconds=1.0, moved=10 << 30, moved_s=10.0)}
    quick = {**base, "p0": _stats("p0", "prefill", loaded=1000, load_s=0.1), "p1": _stats("p1", "prefill")}
    assert plan_fetch(K[:20], dec, [p0, p1], quick, BS, 0.75).source == "p0"   # 2 more blocks, loads of 0.1 ms
    slow = {**quick, "p0": _stats("p0", "prefill", loaded=1000, load_s=20.0)}  # 20 ms a block from its tier
    assert plan_fetch(K[:20], dec, [p0, p1], slow, BS, 0.75).source == "p1"
