"""Tensor-parallel workers in a cluster (real Ray, gRPC): a colocated worker of TP 2 (rank 0 the
actor, placed in a placement group of two bundles; rank 1 its process) serves greedy tokens equal
to transformers'; a killed rank makes the whole worker dead, Ray restarts it and the request is
retried on it (the client sees its tokens, as for any dead worker). 1P1D with prefill TP 2 /
decode TP 1 (KV over TCP) and prefill TP 1 / decode TP 2 (over NIXL) equal transformers too, with
the KV pulled (the decode worker's handoff counters), DeepSeek's latent cache included (heads
split, the latent whole on each rank). One cluster per topology."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from cluster_harness import ClusterThread
from integration.test_model_families import family_prompts

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig
from cluster.launch.app import ClusterConfig
from cluster.model.model_config import load_model_config
from cluster.types import KVLayout
from router.client import Client
from router.router import RouterConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 10


def _engine(tiny_model_dir, kind: str = "llama") -> EngineConfig:
    return EngineConfig(model=tiny_model_dir(kind), dtype="float32", num_threads=1, kernels="torch",
                        cache=CacheConfig(block_size=4, num_blocks=128), tp_collective_timeout_s=5.0)


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    c = ClusterThread(ClusterConfig(http_port=None, engine=engine, port=0, colocated=True, num_decode=1,
                                    decode_tensor_parallel_size=2, max_tokens_limit=64))
    yield c
    c.stop()


def _ranks(served) -> tuple[psutil.Process, list[psutil.Process]]:
    """The colocated worker's actor process (its stats say its pid) and its follower ranks."""
    actor = psutil.Process(next(s.pid for s in served.stats()))
    return actor, [c for c in actor.children() if "spawn_main" in " ".join(c.cmdline())]


def _generate_all(client: Client, prompts) -> list:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS), prompts))


def test_tp2_worker_serves_exact_tokens_and_a_dead_rank_restarts_it(served, hf_reference):
    client = Client(served.target)
    prompts = family_prompts(lengths=(13, 30, 47))
    for prompt, out in zip(prompts, _generate_all(client, prompts)):
        assert list(out.token_ids) == hf_reference("llama", prompt, MAX_TOKENS)[0]
    served.wait_idle()
    actor, followers = _ranks(served)
    assert len(followers) == 1
    followers[0].kill()
    # The next step's collective fails, the worker ends, Ray restarts it (a rank again beside it),
    # and the router's retry of the request lands on the new incarnation: the client sees its tokens.
    out = client.generate(prompts[0], max_tokens=MAX_TOKENS)
    assert list(out.token_ids) == hf_reference("llama", prompts[0], MAX_TOKENS)[0]
    restarted, followers = _ranks(served)
    assert restarted.pid != actor.pid and len(followers) == 1
    served.wait_idle()


def _block_bytes(model_dir) -> int:
    """Every KV head of one block (4 tokens, fp32) as a single rank holds it: 2 layers of K and V,
    2 heads of 16 for the llama; DeepSeek's latent vector per token (every rank holds it whole)."""
    mc = load_model_config(model_dir)
    if mc.mla is None:
        return 2 * 2 * 4 * 2 * 16 * 4
    return KVLayout.latent(mc.model_id, mc.num_layers, mc.mla.latent_dim, 4, "float32").bytes_per_block()


@pytest.mark.parametrize(("kind", "prefill_tp", "decode_tp", "transport"),
                         [("llama", 2, 1, "tcp"), ("llama", 1, 2, "nixl"), ("deepseek_v3_moe", 1, 2, "nixl")])
def test_handoff_between_tp_sizes_equals_the_single_engine(kind, prefill_tp, decode_tp, transport, tiny_model_dir,
                                                           hf_reference):
    c = ClusterThread(ClusterConfig(http_port=None, engine=_engine(tiny_model_dir, kind), port=0,
                                    data_plane=DataPlaneConfig(transport=transport),
                                    router=RouterConfig(local_prefill_max_tokens=4),
                                    prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
                                    max_tokens_limit=64))
    try:
        prompts = family_prompts(lengths=(13, 30, 47))
        for prompt, out in zip(prompts, _generate_all(Client(c.target), prompts)):
            assert list(out.token_ids) == hf_reference(kind, prompt, MAX_TOKENS)[0]
        decode = next(s for s in c.wait_idle() if s.role == "decode")
        # each prompt's blocks crossed once, every KV head of them
        assert decode.handoff.done == len(prompts) and decode.handoff.failed == 0, decode.handoff
        assert decode.handoff.bytes == sum(-(-len(p) // 4) for p in prompts) * _block_bytes(tiny_model_dir(kind))
    finally:
        c.stop()
