from cluster.kv.hashing import hash_prefix_blocks
from router.policy import LeastLoadedPolicy, PrefixAwarePolicy, RoundRobinPolicy, WorkerView, make_policy

import pytest


def _views(role, n):
    return [WorkerView(f"{role}-{i}", role, blocks_free=100, blocks_total=100) for i in range(n)]


def test_prefix_aware_prefers_the_worker_caching_the_prompt():
    hashes = hash_prefix_blocks(list(range(64)), 16)
    workers = _views("prefill", 3)
    workers[2].remember(hashes[:3])
    assert PrefixAwarePolicy().choose_prefill(hashes, workers).name == "prefill-2"
    workers[2].in_flight = 5                      # ... unless it is much busier than the others
    assert PrefixAwarePolicy().choose_prefill(hashes, workers).name != "prefill-2"


def test_prefix_aware_decode_prefers_free_kv():
    workers = _views("decode", 2)
    workers[0].blocks_free = 10
    assert PrefixAwarePolicy().choose_decode([], workers).name == "decode-1"


def test_least_loaded_and_round_robin():
    workers = _views("prefill", 3)
    workers[0].in_flight, workers[1].in_flight, workers[2].in_flight = 3, 1, 2
    assert LeastLoadedPolicy().choose_prefill([], workers).name == "prefill-1"
    rr = RoundRobinPolicy()
    assert [rr.choose_prefill([], workers).name for _ in range(4)] == ["prefill-0", "prefill-1", "prefill-2",
                                                                        "prefill-0"]


def test_cached_prefix_is_a_prefix_and_lru_bounded():
    hashes = hash_prefix_blocks(list(range(64)), 16)
    w = WorkerView("w", "prefill", cache_capacity=2)
    w.remember(hashes[1:3])
    assert w.cached_prefix(hashes) == 0           # block 0 missing: nothing usable
    w.remember(hashes[:1])
    assert len(w.cached) == 2 and w.cached_prefix(hashes) == 1


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest")
