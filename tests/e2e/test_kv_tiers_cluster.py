"""KV tiers on the real cluster (Ray, gRPC on 127.0.0.1, NIXL): two prefill workers and one decode
worker, pools of 40 blocks, one host tier shared by the node's workers (--kv-host-shared) and each
worker's disk tier under --kv-disk-dir; round-robin routing, so a prompt's next request goes to the
other prefill worker. Prompts evicted from a pool, or computed by the other worker, are served from
the tiers, not recomputed, with the single engine's tokens; a prefill worker SIGKILLed while
requests load costs no request, and the restarted worker finds its disk tier. The router's index,
fed by the workers' KV events, knows which worker holds which block in which tier, and stops
trusting a worker whose events stop. Every test ends with every pool empty."""
from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig
from cluster.kv.hashing import hash_prefix_blocks
from cluster.kv.shared_host import segment_path
from cluster.launch.app import ClusterConfig
from cluster.types import SamplingParams
from cluster_harness import ClusterThread
from router.client import Client
from router.router import RouterConfig
from helpers import free_port

pytestmark = pytest.mark.ray

BS = 4
BLOCKS = 40                  # per worker: two prompts of 61 tokens and their outputs
MAX_TOKENS = 8
FULL = 15                    # full blocks of a 61-token prompt that a hit may reuse (the last token is computed)


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (61,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, single_engine):
    engine = single_engine(EngineConfig(model=tiny_model_dir("llama"), dtype="float32", num_threads=1,
                                    cache=CacheConfig(block_size=BS, num_blocks=1024, enable_prefix_caching=False)))
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return lambda prompts: [list(o.token_ids) for o in engine.generate(prompts, sp)]


@pytest.fixture(scope="module")
def tiered(tiny_model_dir, tmp_path_factory):
    disk, shared = tmp_path_factory.mktemp("kv-disk"), "test-" + uuid.uuid4().hex[:12]
    cache = CacheConfig(block_size=BS, num_blocks=BLOCKS, kv_host_bytes=2 << 20, kv_host_shared=shared,
                        kv_disk_dir=str(disk), kv_disk_bytes=64 << 20)
    cfg = ClusterConfig(http_port=None, port=free_port(), num_prefill=2, num_decode=1, max_tokens_limit=64,
                        policy="round_robin",
                        engine=EngineConfig(model=tiny_model_dir("llama"), dtype="float32", num_threads=1, cache=cache),
                        data_plane=DataPlaneConfig(transport="nixl"), router=RouterConfig(local_prefill_max_tokens=4, local_prefill_cached_fraction=1.0,
                                               kv_events_period_s=0.2, kv_index_stale_s=2.0))
    c = ClusterThread(cfg)
    c.disk = disk
    yield c
    c.stop()
    assert not segment_path(shared).exists()          # the cluster's stop removed the node's segment


def _prefills(c: ClusterThread) -> dict:
    return {s.name: s for s in c.stats() if s.role == "prefill"}


def _settled(c: ClusterThread, timeout: float = 15.0) -> dict:
    """The prefill workers' stats once the node's shared host tier has stopped changing: workers copy
    new blocks down in the background, after the request that made them has ended. Each reads the
    count from the segment's one index, so they agree (two reads in a row, every worker alike)."""
    limit, last = time.monotonic() + timeout, None
    while True:
        stats = _prefills(c)
        counts = sorted(s.tiers.host_blocks for s in stats.values())
        if counts == last and len(set(counts)) == 1:
            return stats
        assert time.monotonic() < limit, f"the node's host tier has not settled: {counts}"
        last = counts
        time.sleep(0.1)


def _all(c: ClusterThread) -> dict:
    return {s.name: s for s in c.stats()}


def _one(c: ClusterThread, prompt) -> list[int]:
    return list(Client(c.target).generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=120).token_ids)


def _wait_routable(c: ClusterThread, timeout=90.0) -> None:
    limit = time.monotonic() + timeout
    while not all(v.healthy for v in c.cluster.router.views.values()):
        assert time.monotonic() < limit, {n: h.state for n, h in c.cluster.router.health.items()}
        time.sleep(0.1)


def _sum(stats: dict, field: str) -> int:
    return sum(getattr(s, field) if not field.startswith("tiers.") else getattr(s.tiers, field[6:])
               for s in stats.values())


def test_a_prefix_one_worker_computed_is_loaded_by_the_other(tiered, reference):
    """Two prompts that share 14 blocks: the second goes to the other prefill worker (round robin; not
    fully cached on the decode worker, so not prefilled there), which loads the 14 blocks the first
    one stored in the node's host tier and computes only its own 5 tokens."""
    shared, tails = _prompts(seed=1, n=1)[0][:56], _prompts(seed=11, n=2)
    prompts = [shared + tails[0][:5], shared + tails[1][:5]]
    before = _prefills(tiered)
    first = _one(tiered, prompts[0])
    middle = _settled(tiered)                               # its blocks are in the node's host tier
    second = _one(tiered, prompts[1])
    after = _settled(tiered)                                # one index for the node: every worker's count agrees
    assert [first, second] == reference(prompts)
    first_worker = next(n for n in after if middle[n].prompt_tokens_computed > before[n].prompt_tokens_computed)
    other = next(n for n in after if n != first_worker)
    computed = after[other].prompt_tokens_computed - middle[other].prompt_tokens_computed
    loaded = after[other].tiers.loaded_host - middle[other].tiers.loaded_host
    assert (computed, loaded) == (5, 14)                    # only its own tail computed there
    assert after[other].tiers.host_blocks >= FULL + 1      # both prompts' blocks, stored once each
    tiered.wait_idle(timeout=30)


def test_prompts_evicted_from_the_pools_are_served_from_the_tiers(tiered, reference):
    prompts = _prompts(seed=2, n=6)
    first = [_one(tiered, p) for p in prompts]         # three per worker: more than a pool holds
    assert first == reference(prompts)
    before = _all(tiered)
    again = [_one(tiered, p) for p in prompts[:2]]
    after = _all(tiered)
    assert again == first[:2]
    assert _sum(after, "prompt_tokens_computed") - _sum(before, "prompt_tokens_computed") == 2
    assert _sum(after, "tiers.loaded_host") + _sum(after, "tiers.loaded_disk") > \
        _sum(before, "tiers.loaded_host") + _sum(before, "tiers.loaded_disk")
    assert _sum(after, "tiers.corrupt") == 0
    tiered.wait_idle(timeout=30)


def test_a_prefill_worker_killed_while_loading_costs_no_request_and_finds_its_disk(tiered, reference):
    prompts = _prompts(seed=3, n=6)
    assert [_one(tiered, p) for p in prompts] == reference(prompts)
    tiered.wait_idle(timeout=30)
    old = _prefills(tiered)
    victim = sorted(old)[0]
    files = list((tiered.disk / victim).rglob("*.kv"))
    assert len(files) >= old[victim].tiers.disk_blocks > 0
    with ThreadPoolExecutor(len(prompts)) as pool:
        calls = [pool.submit(_one, tiered, p) for p in prompts]
        time.sleep(0.05)                               # requests arriving, their blocks loading
        os.kill(old[victim].pid, signal.SIGKILL)
        outs = [f.result(180) for f in calls]
    assert outs == reference(prompts)
    _wait_routable(tiered)
    tiered.wait_idle(timeout=90)
    new = _prefills(tiered)[victim]
    assert new.incarnation != old[victim].incarnation
    assert new.tiers.recovered >= len(files)           # the restarted worker rebuilt its index from its files
    before = _all(tiered)
    assert [_one(tiered, p) for p in prompts[:2]] == outs[:2]
    after = _all(tiered)
    assert _sum(after, "prompt_tokens_computed") - _sum(before, "prompt_tokens_computed") == 2
    tiered.wait_idle(timeout=30)


def _index_settled(c: ClusterThread, check, timeout=10.0):
    """`check(index)` true within `timeout` (the router reads KV events every 0.2 s)."""
    index, limit = c.cluster.router.workers.kv_index, time.monotonic() + timeout
    while not check(index):
        assert time.monotonic() < limit, index.samples()
        time.sleep(0.1)
    return index


def test_the_router_index_knows_each_workers_blocks_and_distrusts_a_silent_worker(tiered, reference):
    prompt = _prompts(seed=4, n=1)[0]
    keys = hash_prefix_blocks(prompt, BS)
    before = _prefills(tiered)
    assert _one(tiered, prompt) == reference([prompt])[0]
    after = _prefills(tiered)
    computed_on = next(n for n in after if after[n].prompt_tokens_computed > before[n].prompt_tokens_computed)
    other = next(n for n in after if n != computed_on)
    full = len(keys)
    index = _index_settled(tiered, lambda i: i.cached(computed_on, keys).pool == full
                           and i.cached(other, keys).host == full)
    assert index.cached(other, keys).pool == 0          # the other worker holds it only in the node's host tier
    assert not any(index.is_stale(n) for n in _all(tiered))
    os.kill(after[other].pid, signal.SIGSTOP)           # its events stop arriving
    try:
        _index_settled(tiered, lambda i: i.is_stale(other))
        assert index.cached(other, keys).host == 0      # never routed on claims it no longer confirms
        assert index.cached(computed_on, keys).pool == full
    finally:
        os.kill(after[other].pid, signal.SIGCONT)
    _index_settled(tiered, lambda i: not i.is_stale(other) and i.cached(other, keys).host == full)
    tiered.wait_idle(timeout=30)
