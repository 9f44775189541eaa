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


def test_prefix_home_is_the_same_for_every_frontend_unless_overloaded():
    prompts = [hash_prefix_blocks(list(range(i, i + 160)), 16) for i in range(20)]
    homes = [PrefixAwarePolicy().choose_decode(h, _views("decode", 4)).name for h in prompts]
    assert homes == [PrefixAwarePolicy().choose_decode(h, _views("decode", 4)).name for h in prompts]
    assert len(set(homes)) > 1                          # different prefixes spread over the workers
    shared = hash_prefix_blocks(list(range(128)) + [7] * 16, 16)
    other = hash_prefix_blocks(list(range(128)) + [9] * 16, 16)
    workers = _views("decode", 4)
    home = PrefixAwarePolicy().choose_decode(shared, workers)
    assert PrefixAwarePolicy().choose_decode(other, workers) is home   # same first 8 blocks, same home
    home.in_flight = 10                                 # far above the mean: bounded load moves it
    assert PrefixAwarePolicy().choose_decode(shared, workers) is not home
