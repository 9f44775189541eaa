"""Qwen3-MoE, Qwen2-MoE and Mixtral served by a 1P1D cluster over NIXL (real Ray actors, gRPC):
greedy tokens of concurrent requests equal transformers', the prompts' KV computed by the prefill
worker and moved to the decode worker, and each worker's expert load in its stats (the prefill
worker's experts saw the prompts, the decode worker's the generated tokens). One cluster per family."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_harness import ClusterThread
from integration.test_model_families import family_prompts
from tiny_moe_models import MOE_KINDS

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig
from cluster.launch.app import ClusterConfig
from router.client import Client
from router.router import RouterConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=MOE_KINDS)
def served(request, tiny_model_dir):
    engine = EngineConfig(model=tiny_model_dir(request.param), dtype="float32", num_threads=1, kernels="torch",
                          cache=CacheConfig(block_size=4, num_blocks=128))
    c = ClusterThread(ClusterConfig(http_port=None, engine=engine, data_plane=DataPlaneConfig(transport="nixl"), port=0,
                                    router=RouterConfig(local_prefill_max_tokens=4), max_tokens_limit=64))
    c.kind = request.param
    yield c
    c.stop()


def test_greedy_through_prefill_and_decode_workers_with_expert_load(served, hf_reference):
    client = Client(served.target)
    prompts = family_prompts(lengths=(13, 30, 47))
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS), prompts))
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_reference(served.kind, prompt, MAX_TOKENS)[0], \
            f"{served.kind}: prompt of {len(prompt)} tokens"
    stats = {s.role: s for s in served.wait_idle()}
    assert stats["decode"].handoff.done >= len(prompts) and stats["decode"].handoff.failed == 0, stats["decode"]
    prefill_load = {layer: sum(c) for layer, c in stats["prefill"].expert_tokens}
    decode_load = {layer: sum(c) for layer, c in stats["decode"].expert_tokens}
    assert prefill_load.keys() == decode_load.keys() and prefill_load, (prefill_load, decode_load)
    # every prompt token passed each sparse layer of the prefill worker (top_k experts each); the
    # decode worker ran the generated tokens (and perhaps a re-run of the last prompt token)
    assert all(n >= sum(len(p) for p in prompts) for n in prefill_load.values()), prefill_load
    assert all(n > 0 for n in decode_load.values()), decode_load
