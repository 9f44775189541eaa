"""DeepSeek-V3 (latent attention) served by a 1P1D cluster over NIXL, speculating with its MTP
layer (`--speculative mtp`): greedy tokens equal plain decoding on the single engine (and
transformers'), the prefill worker's latent blocks (the MTP layer's among them) moved to the
decode worker as they are: the transfer counters show one latent vector a token and layer, a
quarter of the same model's per-head K and V."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_harness import ClusterThread
from integration.test_model_families import family_prompts

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig, SpeculativeConfig
from cluster.launch.app import ClusterConfig
from cluster.model.mla_engine import mha_bytes_per_token
from cluster.model.model_config import load_model_config
from cluster.types import SamplingParams
from router.client import Client
from router.router import RouterConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 12
KIND = "deepseek_v3_mtp"


def _engine(model_dir, spec: str = "off") -> EngineConfig:
    return EngineConfig(model=model_dir, dtype="float32", num_threads=1, kernels="torch",
                        cache=CacheConfig(block_size=4, num_blocks=128),
                        speculative=SpeculativeConfig(method=spec, num_speculative_tokens=3))


def test_latent_blocks_through_prefill_and_decode_workers(tiny_model_dir, single_engine, hf_reference):
    model = tiny_model_dir(KIND)
    prompts = family_prompts(lengths=(13, 30, 47))
    engine = single_engine(_engine(model))
    single = [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    assert single == [hf_reference(KIND, p, MAX_TOKENS)[0] for p in prompts]
    c = ClusterThread(ClusterConfig(http_port=None, engine=_engine(model, "mtp"), data_plane=DataPlaneConfig(transport="nixl"),
                                    port=0, router=RouterConfig(local_prefill_max_tokens=4), max_tokens_limit=64))
    try:
        client = Client(c.target)
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS), prompts))
        assert [list(o.token_ids) for o in outs] == single
        stats = c.wait_idle()
    finally:
        c.stop()
    decode = next(s for s in stats if s.role == "decode")
    assert decode.handoff.done == len(prompts) and decode.handoff.failed == 0, decode
    assert decode.spec_of("mtp").accepted > 0, "no MTP draft was accepted"
    mc = load_model_config(model)
    blocks = sum(-(-len(p) // 4) for p in prompts)
    layers = mc.num_layers + 1   # the MTP layer's KV rides in the same blocks
    assert decode.handoff.bytes == blocks * 4 * layers * engine.layout.bytes_per_token() // mc.num_layers
    per_token_layer = decode.handoff.bytes / (blocks * 4 * layers)
    assert per_token_layer == 2 * 20 * 4 and 4 * per_token_layer <= mha_bytes_per_token(mc, mc.dtype) / mc.num_layers
