"""A decode worker reads a prefix another worker holds, over the transport, instead of computing it
(router/prefix_fetch.py, `PrefillPlace.FETCHED`), on a real cluster (Ray, gRPC on 127.0.0.1, NIXL):
one prefill worker with a host tier of its own (no node-shared tier: the decode workers cannot see
its blocks, as on another node) and two decode workers, round-robin routing. A prompt whose prefix
the prefill worker holds goes to the decode worker that never saw it; the prefill worker exports
the prefix (from its pool, or loaded from its host tier), the decode worker pulls and checks it,
computes only the rest, and the tokens are the single engine's. Every pool ends empty."""
from __future__ import annotations

import time

import pytest
import torch

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig
from cluster.kv.hashing import hash_prefix_blocks
from cluster.launch.app import ClusterConfig
from cluster.types import SamplingParams
from cluster_harness import ClusterThread
from router.client import Client
from router.router import RouterConfig
from helpers import free_port

pytestmark = pytest.mark.ray

BS = 4
MAX_TOKENS = 8


def _prompts(seed: int, n: int, length: int = 61) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, single_engine):
    engine = single_engine(EngineConfig(model=tiny_model_dir("llama"), dtype="float32", num_threads=1,
                                    cache=CacheConfig(block_size=BS, num_blocks=1024, enable_prefix_caching=False)))
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return lambda prompts: [list(o.token_ids) for o in engine.generate(prompts, sp)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    cache = CacheConfig(block_size=BS, num_blocks=40, kv_host_bytes=2 << 20)
    cfg = ClusterConfig(http_port=None, port=free_port(), num_prefill=1, num_decode=2, max_tokens_limit=64,
                        policy="round_robin",
                        engine=EngineConfig(model=tiny_model_dir("llama"), dtype="float32", num_threads=1, cache=cache),
                        data_plane=DataPlaneConfig(transport="nixl"),
                        router=RouterConfig(local_prefill_max_tokens=4, local_prefill_cached_fraction=0.75,
                                            kv_events_period_s=0.2, prefix_fetch="always"))
    c = ClusterThread(cfg)
    yield c
    c.stop()


def _one(c: ClusterThread, prompt) -> list[int]:
    return list(Client(c.target).generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=120).token_ids)


def _stats(c: ClusterThread) -> dict:
    return {s.name: s for s in c.stats()}


def _held(c: ClusterThread, worker: str, keys, blocks: int, tier: str = "disk", timeout: float = 10.0) -> None:
    index, limit = c.cluster.router.workers.kv_index, time.monotonic() + timeout
    while getattr(index.cached(worker, keys), tier) < blocks:
        assert time.monotonic() < limit, index.samples()
        time.sleep(0.05)


def _fetch_once(c: ClusterThread, reference, seed: int, evict: bool) -> None:
    shared, tails = _prompts(seed, 1)[0][:56], _prompts(seed + 100, 2)
    first, second = shared + tails[0][:5], shared + tails[1][:5]
    assert _one(c, first) == reference([first])[0]          # prefill worker -> the next decode worker
    if evict:   # other prompts push it out of the prefill worker's pool: it is then in its host tier only
        others = _prompts(seed + 200, 3)
        assert [_one(c, p) for p in others] == reference(others)
        _one(c, others[0])      # round robin: the next request's decode worker is the one `first` did not use
    c.wait_idle(timeout=30)
    _held(c, "prefill-0", hash_prefix_blocks(second, BS), 14, "pool" if not evict else "disk")
    before = _stats(c)
    assert _one(c, second) == reference([second])[0]
    after = _stats(c)
    fetcher = next(n for n in after if after[n].role == "decode"
                   and after[n].handoff.fetched > before[n].handoff.fetched)
    assert after[fetcher].handoff.fetched_blocks - before[fetcher].handoff.fetched_blocks == 14
    assert after[fetcher].prompt_tokens_computed - before[fetcher].prompt_tokens_computed == 5   # its own tail
    # The export computed only its last block (a prefill never ends on a cache hit); its KV came
    # from the pool or was loaded back from the host tier.
    exported = after["prefill-0"].prompt_tokens_computed - before["prefill-0"].prompt_tokens_computed
    assert exported == BS
    if evict:
        assert after["prefill-0"].tiers.loaded_host > before["prefill-0"].tiers.loaded_host
    c.wait_idle(timeout=30)


def test_a_prefix_in_another_workers_pool_is_pulled_not_computed(cluster, reference):
    _fetch_once(cluster, reference, seed=1, evict=False)


def test_a_prefix_in_another_workers_host_tier_is_loaded_there_and_pulled(cluster, reference):
    _fetch_once(cluster, reference, seed=2, evict=True)
