"""Qwen3-MoE, Qwen2-MoE and Mixtral through the engine in float32: greedy tokens equal
transformers' on tiny random checkpoints (tests/tiny_moe_models.py), on torch ops and on the C
kernels; the MoE shape is read from config.json (sparse layers, shared expert), what is not built
is refused by name, experts count their tokens, and the deterministic mode's expert compute gives
a row the same bits whatever rows share its batch."""
from __future__ import annotations

import json

import pytest
import torch
from integration.test_model_families import _fused_plan, check_family, family_prompts
from tiny_moe_models import MOE_KINDS

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.model.model_config import load_model_config, parse_model_config
from cluster.model.moe import (
    MoEExperts,
    MoEPath,
    expert_token_counts,
    mixtral_topk,
    softmax_topk,
)
from cluster.model.moe_config import Routing
from kernels import cpu_ops


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_greedy_equals_transformers_on_torch_ops(kind, tiny_model_dir, hf_reference):
    """Each prompt prefilled whole, then batched decodes; every expert token counted."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(kind), dtype="float32", kernels="torch"))
    prompts = family_prompts(lengths=(3, 13, 30))
    check_family(engine, kind, prompts, hf_reference)
    cfg = engine.model_config.moe
    counts = expert_token_counts(engine.model)
    assert [layer for layer, _ in counts] == [i for i, s in enumerate(cfg.sparse_layers) if s]
    # every prompt token and every decoded token but the last passed every sparse layer, top_k times
    tokens = sum(len(p) for p in prompts) + len(prompts) * 15
    assert all(sum(c) == tokens * cfg.top_k and len(c) == cfg.num_experts for _, c in counts), counts


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler: fused CPU ops not built")
def test_c_kernels_chunked_with_prefix_hits(tiny_model_dir, hf_reference):
    """Qwen2-MoE (dense and sparse layers, the gated shared expert) on the C kernels: the experts on
    the C path, prefill chunks of at most 9 tokens beside decodes, prompts from cached blocks."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("qwen2moe"), dtype="float32", kernel_plan=_fused_plan(),
                                    cache=CacheConfig(block_size=4, num_blocks=256),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=9)))
    assert {m.path for m in engine.model.modules() if isinstance(m, MoEExperts)} == {MoEPath.FUSED_C}
    prompts = family_prompts(shared_prefix=12, lengths=(3, 13, 30))
    check_family(engine, "qwen2moe", prompts[:1], hf_reference)
    outs = check_family(engine, "qwen2moe", prompts[1:], hf_reference)
    assert all(o.num_cached_tokens >= 12 for o in outs), [o.num_cached_tokens for o in outs]


def test_moe_shapes_are_read(tiny_model_dir):
    q3 = load_model_config(tiny_model_dir("qwen3moe")).moe
    assert (q3.num_experts, q3.top_k, q3.expert_intermediate_size, q3.norm_topk_prob) == (8, 2, 32, True)
    assert q3.sparse_layers == (True, False, True) and q3.routing is Routing.SOFTMAX_TOPK   # mlp_only_layers [1]
    q2 = load_model_config(tiny_model_dir("qwen2moe"))
    assert q2.moe.sparse_layers == (False, True, False) and q2.qkv_bias and not q2.o_bias   # decoder_sparse_step 2
    assert (q2.moe.shared_expert_intermediate_size, q2.moe.shared_expert_gate, q2.moe.norm_topk_prob) == (48, True, False)
    mix = load_model_config(tiny_model_dir("mixtral")).moe
    assert mix.sparse_layers == (True,) * 3 and mix.routing is Routing.MIXTRAL and mix.expert_intermediate_size == 128
    assert load_model_config(tiny_model_dir("qwen3moe")).qk_norm


def _raw(tiny_model_dir, kind: str, **changes) -> dict:
    return {**json.loads((tiny_model_dir(kind) / "config.json").read_text()), **changes}


@pytest.mark.parametrize("kind, changes, named", [
    ("qwen3moe", {"architectures": ["OlmoeForCausalLM"]}, r"OlmoeForCausalLM: this mixture-of-experts family"),
    ("qwen3moe", {"hidden_act": "gelu"}, r"activation 'gelu'"),
    ("qwen3moe", {"use_sliding_window": True, "sliding_window": 8}, r"sliding-window attention on Qwen3MoeForCausalLM"),
    ("qwen2moe", {"moe_intermediate_size": None}, r"moe_intermediate_size"),
    ("mixtral", {"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\)"),
])
def test_unbuilt_moe_features_are_refused_by_name(kind, changes, named, tiny_model_dir):
    raw = {k: v for k, v in _raw(tiny_model_dir, kind, **changes).items() if v is not None}
    with pytest.raises(ValueError, match=named):
        parse_model_config(raw, model_id=kind)


def test_quantization_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--quantization int8: quantized experts of a mixture-of-experts model"):
        LLMEngine(EngineConfig(model=tiny_model_dir("mixtral"), dtype="float32", kernels="torch", quantization="int8"))


def test_routers_follow_transformers():
    """Qwen's weights come back in the logits' dtype, Mixtral's stay float32; both renormalize."""
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    ids, w = softmax_topk(logits, 2, renormalize=False)
    assert w.dtype == torch.bfloat16 and ids.shape == (5, 2) and bool((w.float().sum(-1) < 1.01).all())
    ids, w = mixtral_topk(logits, 2)
    assert w.dtype == torch.float32 and torch.allclose(w.sum(-1), torch.ones(5))


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler: fused CPU ops not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_experts_are_batch_invariant(dtype):
    """A row's output on the invariant path is the same bits alone, in a batch of 64 and in a
    batch whose other rows send every expert many tokens (BLAS would block differently)."""
    torch.manual_seed(0)
    experts = MoEExperts(8, 64, 96).to(dtype)
    with torch.no_grad():
        experts.gate_up.normal_(0, 0.1)
        experts.down.normal_(0, 0.1)
    experts.path = MoEPath.INVARIANT
    x = torch.randn(200, 64, dtype=dtype)
    ids, w = softmax_topk(torch.randn(200, 8), 2, renormalize=True)
    full = experts.forward(x, ids, w)
    for rows in (slice(0, 1), slice(7, 71), slice(150, 200)):
        assert torch.equal(experts.forward(x[rows], ids[rows], w[rows]), full[rows])
