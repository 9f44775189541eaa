"""Tensor parallelism in one engine (cluster/parallel/): float32 greedy with TP 2 equals the single
engine token for token on Llama (GQA 4/2), Qwen2 (one KV head, replicated on both ranks; tied
head) and Qwen3 (q/k norms); 4 ranks on this 2-core machine run unpinned and still equal it; each
rank holds its share of the weights and KV; a dead follower or one that hangs in a collective
makes the engine fail within the collective deadline instead of waiting forever. Mixtures of
experts (tests/tiny_moe_models.py) equal it too, their experts sliced (TP) or placed whole on the
ranks (`enable_expert_parallel`), Qwen2-MoE's shared expert sliced."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.eplb_config import ExpertBalanceConfig
from cluster.model.moe import MoEExperts
from cluster.parallel.expert_balancer import placed_experts
from cluster.parallel.expert_placement import contiguous_placement
from cluster.types import SamplingParams
from tests.integration.test_model_families import family_prompts

pytestmark = pytest.mark.slow
SAMPLING = SamplingParams(max_tokens=12, logprobs=0)


def _config(model, **kw) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", kernels="torch", **kw)


def _assert_equal(tp_engine: LLMEngine, single: LLMEngine, prompts) -> None:
    ours = tp_engine.generate(prompts, SAMPLING)
    ref = single.generate(prompts, SAMPLING)
    for a, b in zip(ours, ref):
        assert list(a.token_ids) == list(b.token_ids)
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
    tp_engine.pool.check_idle()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tp2_equals_the_single_engine(kind, tiny_model_dir, single_engine):
    model = tiny_model_dir(kind)
    single = single_engine(_config(model))
    engine = LLMEngine(_config(model, tensor_parallel_size=2))
    try:
        _assert_equal(engine, single, family_prompts())
        # rank 0 holds half of every sharded weight and half the KV heads (Qwen2's one head: all of it)
        layer, full = engine.model.layers[0], single.model.layers[0]
        assert layer.mlp.down_proj.inner.in_features * 2 == full.mlp.down_proj.in_features
        assert layer.mlp.gate_up_proj.out_features * 2 == full.mlp.gate_up_proj.out_features
        assert engine.model.lm_head.inner.out_features == -(-single.model_config.vocab_size // 2)
        assert engine.layout.num_kv_heads == max(1, single.layout.num_kv_heads // 2)
        assert engine.layout.tp_size == 2 and engine.runner.step_sender.messages > 0
    finally:
        engine.close()


@pytest.mark.parametrize(("kind", "expert_parallel"), [("qwen3moe", False), ("qwen2moe", True), ("mixtral", True)])
def test_mixtures_of_experts_equal_the_single_engine(kind, expert_parallel, tiny_model_dir, single_engine):
    model = tiny_model_dir(kind)
    single = single_engine(_config(model))
    engine = LLMEngine(_config(model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel))
    try:
        _assert_equal(engine, single, family_prompts(lengths=(13, 30)))
        ours = next(m for m in engine.model.modules() if isinstance(m, MoEExperts))
        full = next(m for m in single.model.modules() if isinstance(m, MoEExperts))
        if expert_parallel:   # whole experts, half of them here; the load counters see every expert
            assert ours.gate_up.shape[0] * 2 == full.gate_up.shape[0] == len(ours.token_counts())
        else:                 # every expert, half of its intermediate rows
            assert ours.down.shape == (*full.down.shape[:2], full.down.shape[2] // 2)
    finally:
        engine.close()


@pytest.mark.parametrize(("kind", "expert_parallel"), [("deepseek_v3_moe", False), ("deepseek_v2_moe", True),
                                                     ("deepseek_v3_noq", False)])
def test_latent_attention_models_equal_the_single_engine(kind, expert_parallel, tiny_model_dir, single_engine):
    """DeepSeek at TP 2 (cluster/parallel/mla_sharding.py): query heads split, the latent replicated
    (each rank caches the whole latent), experts sliced or placed whole, shared experts sliced."""
    model = tiny_model_dir(kind)
    single = single_engine(_config(model))
    engine = LLMEngine(_config(model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel))
    try:
        _assert_equal(engine, single, family_prompts(lengths=(13, 30)))
        assert engine.model.layers[0].self_attn.num_heads * 2 == single.model.layers[0].self_attn.num_heads
        assert engine.layout.bytes_per_block() == single.layout.bytes_per_block()   # the whole latent per rank
        assert engine.kv_export.layout.layout_hash() == single.layout.layout_hash()  # a handoff moves it as TP 1's
    finally:
        engine.close()


def test_the_expert_balancer_moves_experts_between_passes_and_tokens_stay_equal(tiny_model_dir, single_engine):
    """--enable-eplb with 2 redundant slots, a look every 2 passes and any gain applied: experts move
    between the ranks mid-generation (rank 0 sends the placement, both ranks exchange weights) and
    the tokens still equal the single engine's; every pair ran on exactly one rank."""
    model = tiny_model_dir("qwen3moe")
    eplb = ExpertBalanceConfig(enable_eplb=True, num_redundant_experts=2, eplb_step_interval=2, eplb_min_gain=0.0)
    engine = LLMEngine(_config(model, tensor_parallel_size=2, enable_expert_parallel=True, eplb=eplb))
    try:
        _assert_equal(engine, single_engine(_config(model)), family_prompts(lengths=(13, 30)))
        balancer = engine.runner.balancer
        assert balancer.rebalances >= 1 and len(balancer.history) >= 3
        layers = placed_experts(engine.model)
        assert all(len(slots) == 5 for layer in layers for slots in layer.placement.ranks)
        assert any(layer.placement != contiguous_placement(8, 2, 2) for layer in layers)
        for layer in layers:   # each (token, expert) pair ran on exactly one rank
            assert sum(layer.rank_tokens.tolist()) == sum(layer.token_counts())
    finally:
        engine.close()


def test_more_ranks_than_cores_run_unpinned_and_equal(tiny_model_dir, single_engine, caplog):
    """4 ranks on 2 cores: one thread each, unpinned (said in the log, never refused); Qwen2's one
    KV head replicated on all four."""
    model = tiny_model_dir("qwen2")
    caplog.set_level(logging.INFO, logger="cluster.engine.builder")
    engine = LLMEngine(_config(model, tensor_parallel_size=4, cpus=(0, 1)))
    try:
        assert any("4 ranks on 2 cores: unpinned, 1 thread each" in r.message for r in caplog.records)
        _assert_equal(engine, single_engine(_config(model)), family_prompts(lengths=(5, 21)))
    finally:
        engine.close()


def _follower_pid(engine: LLMEngine) -> int:
    return engine.ranks.processes[0].pid


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_dead_or_hung_rank_fails_the_engine_within_the_deadline(fault, tiny_model_dir):
    engine = LLMEngine(_config(tiny_model_dir("llama"), tensor_parallel_size=2, tp_collective_timeout_s=3.0))
    pid = _follower_pid(engine)
    try:
        assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids) == 2
        os.kill(pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))
        assert time.monotonic() - start < 30
    finally:
        if fault == "hung":
            os.kill(pid, signal.SIGCONT)
        engine.close()
