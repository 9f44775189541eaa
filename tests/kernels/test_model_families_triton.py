"""Qwen3, Gemma 3 and Phi-3 on the Triton attention backend (interpreted on CPU): greedy tokens and
their log-probabilities equal transformers' (tests/integration/test_model_families.py's reference)
through steps that mix decodes with chunked prefills over cached prefixes, prompts past the
sliding windows; Gemma's softmax scale (query_pre_attn_scalar) reaches the kernels.

One small scenario per family: the interpreter makes every engine step cost ~0.2 s."""
import pytest

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from integration.test_model_families import FAMILIES, check_family, family_prompts


@pytest.mark.parametrize("kind", FAMILIES)
def test_mixed_steps_with_prefix_hits(kind, tiny_model_dir, hf_reference):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(kind), dtype="float32", attention_backend="triton",
                                    cache=CacheConfig(block_size=4, num_blocks=128),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    assert engine.backend.name == "triton" and engine.backend.scale == engine.model_config.attention_scale
    seen = []
    prepare = engine.backend.prepare

    def spy(batch):
        seen.append((batch.num_decode, len(batch.prefills), sum(s.context_len > s.query_len for s in batch.prefills)))
        return prepare(batch)
    engine.backend.prepare = spy
    prompts = family_prompts(shared_prefix=8, lengths=(3, 6, 14, 22))
    check_family(engine, kind, prompts[:1], hf_reference, max_tokens=6)
    outs = check_family(engine, kind, prompts[1:], hf_reference, max_tokens=6)
    assert all(o.num_cached_tokens >= 8 for o in outs), [o.num_cached_tokens for o in outs]
    assert any(d and p for d, p, _ in seen), f"no step mixed decodes with prefill chunks: {seen}"
    assert any(hit for *_, hit in seen), "no prefill chunk ran over a cached prefix"
