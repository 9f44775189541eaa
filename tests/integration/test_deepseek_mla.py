"""DeepSeek-V3 and V2 (multi-head latent attention) through the engine in float32: greedy tokens
and log-probabilities equal transformers' on tiny random checkpoints (tests/tiny_models.py: low-rank
and plain queries, yarn RoPE, interleaved and half-split RoPE, and expert layers: V3's grouped
sigmoid routing with its correction bias, V2's group-limited greedy softmax, shared experts), on
torch ops and on the C kernels with chunked prefill over cached prefixes; the latent cache holds a quarter of the same model's
per-head K/V; what the latent layout does not do is refused by name. DeepSeek-V3's MTP layer
speculates (`--speculative mtp`) with output equal to plain decoding."""
from __future__ import annotations

import json
import shutil

import pytest

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.model.mla_engine import latent_kv_line, mha_bytes_per_token
from cluster.model.model_config import load_model_config
from cluster.types import SamplingParams
from decode.spec.speculator import make_speculator
from kernels import cpu_ops
from tests.integration.test_model_families import (
    _fused_plan,
    check_family,
    family_prompts,
)

KINDS = ["deepseek_v3", "deepseek_v3_noq", "deepseek_v2", "deepseek_v3_moe", "deepseek_v2_moe"]


def test_torch_ops_whole_prompts(tiny_model_dir, hf_reference):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("deepseek_v3"), dtype="float32", kernels="torch"))
    check_family(engine, "deepseek_v3", family_prompts(), hf_reference)


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler: fused CPU ops not built")
@pytest.mark.parametrize("kind", KINDS)
def test_c_kernels_chunked_with_prefix_hits(kind, tiny_model_dir, hf_reference):
    """The absorbed decode in C, 4-token blocks, prefill chunks of at most 9 tokens beside decodes
    (their context gathered from the latent cache), prompts that start from cached blocks."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(kind), dtype="float32", kernel_plan=_fused_plan(),
                                    cache=CacheConfig(block_size=4, num_blocks=256),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=9)))
    assert engine.runner.backend.decode_kernel is cpu_ops.mla_decode
    prompts = family_prompts(shared_prefix=12)
    check_family(engine, kind, prompts[:1], hf_reference)
    outs = check_family(engine, kind, prompts[1:], hf_reference)
    assert all(o.num_cached_tokens >= 12 for o in outs), [o.num_cached_tokens for o in outs]
    if kind.endswith("_moe"):   # the sparse layer's experts counted the tokens routed to them (top 2)
        counts = engine.model.layers[1].mlp.experts.token_counts()
        assert sum(counts) % 2 == 0 and sum(counts) > 0, counts


def test_latent_layout_is_a_quarter_of_mha(tiny_model_dir):
    """One (32 + 8)-wide vector per token and layer, against 4 heads x (24 + 16) of K and V."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("deepseek_v3"), dtype="float32", kernels="torch",
                                    cache=CacheConfig(num_blocks=16)))
    layout, mc = engine.layout, load_model_config(tiny_model_dir("deepseek_v3"))
    assert (layout.latent_dim, layout.num_kv_heads, layout.head_dim) == (40, 1, 20)
    assert layout.bytes_per_token() == 2 * 40 * 4
    assert layout.bytes_per_token() * 4 <= mha_bytes_per_token(mc, mc.dtype) == 2 * 4 * 40 * 4
    assert engine.kv_cache.nbytes() == 16 * layout.bytes_per_block()
    assert latent_kv_line(mc, mc.dtype, 16).endswith("320 B a token, 25.0% of per-head K and V (1,280 B)")


def _copy_with(tiny_model_dir, tmp_path, kind: str, **changes):
    model = tmp_path / kind
    shutil.copytree(tiny_model_dir(kind), model)
    raw = json.loads((model / "config.json").read_text())
    raw.update(changes)
    (model / "config.json").write_text(json.dumps(raw))
    return model


@pytest.mark.parametrize("changes, settings, named", [
    ({}, {"cache": CacheConfig(kv_cache_dtype="int8")}, r"quantized KV cache \(--kv-cache-dtype int8\).*MLA"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}}, {}, r"RoPE scaling 'llama3'"),
    ({"hidden_act": "gelu"}, {}, r"hidden activation 'gelu'"),
    ({"first_k_dense_replace": 1, "topk_method": "group_limited_greedy"}, {}, r"topk_method='group_limited_greedy'"),
    ({}, {"cuda_graphs": "on"}, r"decode graphs \(--cuda-graphs on\) are not supported with latent attention"),
    ({}, {"speculative": SpeculativeConfig(method="eagle")}, r"--speculative eagle is not supported with latent"),
])
def test_what_the_latent_model_lacks_is_refused_by_name(tiny_model_dir, tmp_path, changes, settings, named):
    model = _copy_with(tiny_model_dir, tmp_path, "deepseek_v3", **changes)
    with pytest.raises(ValueError, match=named):
        LLMEngine(EngineConfig(model=model, dtype="float32", kernels="torch", **settings),
                  speculator_factory=make_speculator)


def test_mtp_speculation_equals_plain_decoding(tiny_model_dir, single_engine):
    """`--speculative mtp` drafts with the checkpoint's MTP layer (tests/tiny_models.py builds one
    that repeats the pending token): accepted in repetitive stretches, output as plain decoding's."""
    model = tiny_model_dir("deepseek_v3_mtp")
    prompts = family_prompts()
    plain = single_engine(EngineConfig(model=model, dtype="float32", kernels="torch"))
    expected = [list(o.token_ids) for o in plain.generate(prompts, SamplingParams(max_tokens=16))]
    spec = LLMEngine(EngineConfig(model=model, dtype="float32", kernels="torch",
                                  speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=3)),
                     speculator_factory=make_speculator)
    assert [list(o.token_ids) for o in spec.generate(prompts, SamplingParams(max_tokens=16))] == expected
    counts = spec.speculator.counts["mtp"]
    assert counts["drafted"] > 0 and counts["accepted"] > 0, counts
    assert spec.layout.num_layers == 3 and spec.layout.model_id.endswith("+mtp")
    spec.pool.check_idle()


def test_mtp_without_its_weights_is_refused_by_name(tiny_model_dir):
    """transformers saves no MTP layer: the config names one (num_nextn_predict_layers 1), the
    checkpoint serves without it (the tests above), and `--speculative mtp` is refused."""
    model = tiny_model_dir("deepseek_v3")
    assert load_model_config(model).mla.num_mtp_layers == 1
    with pytest.raises(ValueError, match=r"--speculative mtp: .*lacks their weights .*model\.layers\.2\.enorm"):
        LLMEngine(EngineConfig(model=model, dtype="float32", kernels="torch",
                               speculative=SpeculativeConfig(method="mtp")), speculator_factory=make_speculator)
    with pytest.raises(ValueError, match=r"--speculative mtp needs a DeepSeek-V3 checkpoint"):
        LLMEngine(EngineConfig(model=tiny_model_dir("deepseek_v2"), dtype="float32", kernels="torch",
                               speculative=SpeculativeConfig(method="mtp")), speculator_factory=make_speculator)


def test_latent_blocks_go_through_the_host_tier(tiny_model_dir, single_engine):
    """A host tier keeps latent blocks evicted from a small pool: a prompt seen before loads its
    prefix from it, and the output is the one computed from scratch."""
    model = tiny_model_dir("deepseek_v3")
    prompts = family_prompts(lengths=(30, 30, 30))
    expected = [list(o.token_ids) for o in single_engine(EngineConfig(model=model, dtype="float32", kernels="torch"))
                .generate(prompts, SamplingParams(max_tokens=4))]
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", kernels="torch",
                                    cache=CacheConfig(block_size=4, num_blocks=12, kv_host_bytes=1 << 20)))
    for prompt, out in zip(prompts, expected):   # each evicts the one before from the 12-block pool
        assert list(engine.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids) == out
    again = engine.generate([prompts[0]], SamplingParams(max_tokens=4))[0]
    assert list(again.token_ids) == expected[0] and again.num_cached_tokens == 28
    assert engine.tiers.stats().loaded_host == 7
