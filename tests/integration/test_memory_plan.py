"""The memory plan covers everything the engine allocates: with a draft model its weights and its
KV (a block per target block, plus lookahead room) come out of the same budget as the target's.
`--kv-cache-memory` is what the KV arena really takes."""
from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from decode.spec.speculator import make_speculator

BUDGET = 96 << 20


def _weights(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def test_a_draft_model_is_planned_inside_the_budget():
    plain = LLMEngine(EngineConfig(cache=CacheConfig(memory_budget_bytes=BUDGET)))
    drafted = LLMEngine(EngineConfig(cache=CacheConfig(memory_budget_bytes=BUDGET),
                                     speculative=SpeculativeConfig(method="draft")), speculator_factory=make_speculator)
    draft = drafted.speculator.proposers["draft"]
    plan = drafted.memory_plan
    allocated = (drafted.kv_cache.nbytes() + draft.cache.arena.numel() * draft.cache.arena.element_size()
                 + _weights(drafted.model) + _weights(draft.model))
    assert allocated + plan.activation_bytes + plan.headroom_bytes <= BUDGET
    assert drafted.pool.num_blocks < plain.pool.num_blocks
    assert plain.memory_plan.weight_bytes == _weights(plain.model)   # no draft: nothing extra planned


def test_kv_cache_memory_is_the_arenas_size():
    per_block = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=1))).layout.bytes_per_block()
    engine = LLMEngine(EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=40 * per_block + per_block // 2)))
    assert engine.pool.num_blocks == 40 and engine.memory_plan.limit.startswith("--kv-cache-memory (")
    assert engine.kv_cache.nbytes() == engine.memory_plan.kv_bytes == 40 * per_block
