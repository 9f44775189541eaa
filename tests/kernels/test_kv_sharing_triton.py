"""Cross-layer KV sharing on the Triton attention backend (interpreted on CPU): a Gemma 4 tiny
checkpoint whose last 3 layers attend earlier layers' K/V (tests/integration/test_kv_sharing.py)
gives transformers' greedy tokens and log-probabilities through steps that mix decodes with prefill
chunks over a cached prefix; the sharing layers skip the store kernel and read their source's cache."""
from integration.test_kv_sharing import _check, reference  # noqa: F401 (a fixture)
from integration.test_model_families import family_prompts

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine


def test_mixed_steps_with_prefix_hits(tiny_model_dir, reference):  # noqa: F811
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("gemma4"), dtype="float32", attention_backend="triton",
                                    cache=CacheConfig(block_size=4, num_blocks=128),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    assert engine.backend.name == "triton" and engine.kv_cache.arena.shape[0] == 3
    seen = []
    prepare = engine.backend.prepare
    engine.backend.prepare = lambda batch: (seen.append((batch.num_decode, len(batch.prefills))), prepare(batch))[1]
    prompts = family_prompts(shared_prefix=8, lengths=(3, 14, 22))
    _check(engine, "gemma4", prompts[:1], reference)
    outs = _check(engine, "gemma4", prompts[1:], reference)
    assert all(o.num_cached_tokens >= 8 for o in outs), [o.num_cached_tokens for o in outs]
    assert any(d and p for d, p in seen), f"no step mixed decodes with prefill chunks: {seen}"
