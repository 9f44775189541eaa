"""Greedy output equals transformers token for token, in every scheduling regime, and the
block pool ends where it started."""
from __future__ import annotations

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams

KINDS = ["llama", "qwen2", "mistral"]
MAX_TOKENS = 20


def _prompts(shared_prefix: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 384, (shared_prefix,), generator=g).tolist()
    lengths = (3, 11, 16, 29, 47)   # below, at and across block boundaries; longer than the window
    return [prefix + torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir):
    import transformers
    models, cache = {}, {}

    def ref(kind: str, prompt: list[int]) -> list[int]:
        key = (kind, tuple(prompt))
        if key not in cache:
            if kind not in models:
                models[kind] = transformers.AutoModelForCausalLM.from_pretrained(
                    tiny_model_dir(kind), dtype=torch.float32).eval()
            out = models[kind].generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]
    return ref


def _engine(model_dir, block_size=16, num_blocks=256, budget=2048, max_seqs=64) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model_dir, dtype="float32",
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)))


def _check(engine: LLMEngine, kind: str, prompts, hf_greedy) -> list:
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(kind, prompt), f"{kind}: prompt of {len(prompt)} tokens"
    engine.pool.check_idle()
    return outs


@pytest.mark.parametrize("kind", KINDS)
def test_no_cache_hits(kind, tiny_model_dir, hf_greedy):
    engine = _engine(tiny_model_dir(kind))
    outs = _check(engine, kind, _prompts(), hf_greedy)
    assert all(o.num_cached_tokens == 0 for o in outs)


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_hits_cache(kind, tiny_model_dir, hf_greedy):
    engine = _engine(tiny_model_dir(kind), block_size=4)
    prompts = _prompts(shared_prefix=24)
    _check(engine, kind, prompts[:1], hf_greedy)            # warms the cache with the shared prefix
    outs = _check(engine, kind, prompts[1:], hf_greedy)
    assert all(o.num_cached_tokens >= 24 for o in outs), [o.num_cached_tokens for o in outs]
    # The same prompts again: everything but the last block is served from the cache.
    again = _check(engine, kind, prompts, hf_greedy)
    assert all(o.num_cached_tokens >= len(p) - 4 for o, p in zip(again, prompts))


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_small_budget(kind, tiny_model_dir, hf_greedy):
    engine = _engine(tiny_model_dir(kind), block_size=4, budget=7)
    _check(engine, kind, _prompts(shared_prefix=10), hf_greedy)


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_under_tiny_block_budget(kind, tiny_model_dir, hf_greedy):
    # 5 prompts of up to ~67 tokens + 20 new ones in 4-token blocks, with 30 blocks in all:
    # they cannot all run at once, so the scheduler must preempt and recompute.
    engine = _engine(tiny_model_dir(kind), block_size=4, num_blocks=30, budget=64)
    preempted = []
    original = engine.scheduler.preempt

    def spy(seq, plan):
        preempted.append(seq.request_id)
        original(seq, plan)
    engine.scheduler.preempt = spy
    _check(engine, kind, _prompts(shared_prefix=20), hf_greedy)
    assert preempted, "the block budget was meant to force preemption"


def test_preemption_without_prefix_cache(tiny_model_dir, hf_greedy):
    engine = LLMEngine(EngineConfig(
        model=tiny_model_dir("llama"), dtype="float32",
        cache=CacheConfig(block_size=4, num_blocks=24, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    _check(engine, "llama", _prompts(), hf_greedy)
