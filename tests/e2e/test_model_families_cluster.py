"""Qwen3, Gemma 3 (text) and Phi-3 served by a 1P1D cluster (real Ray actors, gRPC, KV over TCP):
greedy tokens of concurrent requests equal transformers', prompts past the sliding windows, the
KV computed by the prefill worker and decoded by the decode worker. One cluster per family."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.launch.app import ClusterConfig
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig
from cluster_harness import ClusterThread
from integration.test_model_families import FAMILIES, family_prompts
from router.client import Client

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tiny_model_dir):
    engine = EngineConfig(model=tiny_model_dir(request.param), dtype="float32", num_threads=1, kernels="torch",
                          cache=CacheConfig(block_size=4, num_blocks=128))
    c = ClusterThread(ClusterConfig(http_port=None, engine=engine, data_plane=DataPlaneConfig(transport="tcp"), port=0,
                                    router=RouterConfig(local_prefill_max_tokens=4),
                                    max_tokens_limit=64))
    c.kind = request.param
    yield c
    c.stop()


def test_greedy_through_prefill_and_decode_workers(served, hf_reference):
    client = Client(served.target)
    prompts = family_prompts(lengths=(13, 30, 47))
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS), prompts))
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_reference(served.kind, prompt, MAX_TOKENS)[0], \
            f"{served.kind}: prompt of {len(prompt)} tokens"
    stats = served.wait_idle()
    decode = next(s for s in stats if s.role == "decode")
    assert decode.handoff.done >= len(prompts) and decode.handoff.failed == 0, decode
