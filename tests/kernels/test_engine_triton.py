"""The engine's exactness against transformers holds with the Triton backend (interpreted on
CPU): greedy tokens equal transformers' for GQA (llama), MQA (qwen2) and sliding-window
(mistral) models, through steps that mix decodes, chunked prefills and prefix-cache hits, and
with speculative verification; the block pool ends where it started.

Reuses tests/integration's prompts and transformers reference; each scenario runs once per kind
because the interpreter makes every engine step cost ~0.2 s."""
import pytest

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from integration.test_engine_exactness import KINDS, _check, _prompts, hf_greedy  # noqa: F401, F811 (a fixture)


def _engine(model_dir, speculator_factory=None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype="float32", attention_backend="triton", **kw),
                     speculator_factory=speculator_factory)


def _count_steps(engine):
    """Wraps prepare to record what kinds of work each step carried."""
    seen = []
    prepare = engine.backend.prepare

    def spy(batch):
        seen.append((batch.num_decode, len(batch.verifies), len(batch.prefills),
                     sum(s.context_len > s.query_len for s in batch.prefills)))
        return prepare(batch)
    engine.backend.prepare = spy
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_steps_with_prefix_hits(kind, tiny_model_dir, hf_greedy):
    # 4-token blocks, a 24-token shared prefix, 24 tokens of budget: prompts arrive while others
    # decode, their prefills are chunked, and every later prompt starts from cached blocks.
    engine = _engine(tiny_model_dir(kind), cache=CacheConfig(block_size=4, num_blocks=256),
                     scheduler=SchedulerConfig(max_num_batched_tokens=24))
    assert engine.backend.name == "triton"
    steps = _count_steps(engine)
    prompts = _prompts(shared_prefix=24)
    _check(engine, kind, prompts[:1], hf_greedy)
    outs = _check(engine, kind, prompts[1:], hf_greedy)
    assert all(o.num_cached_tokens >= 24 for o in outs)
    assert any(d and p for d, _, p, _ in steps), "no step mixed decodes with prefill chunks"
    assert any(hit for *_, hit in steps), "no prefill chunk ran over a cached prefix"


def test_speculative_verification(tiny_model_dir, hf_greedy):
    """The tiny model drafts for itself: nearly every draft is accepted, so steps carry batched
    verification spans of k+1 queries (ragged once sequences near their token limit)."""
    from decode.spec.speculator import make_speculator
    model = tiny_model_dir("llama")
    engine = _engine(model, make_speculator, cache=CacheConfig(block_size=4, num_blocks=256),
                     speculative=SpeculativeConfig(method="draft", draft_model=model))
    steps = _count_steps(engine)
    _check(engine, "llama", _prompts()[:3], hf_greedy)
    assert sum(v for _, v, _, _ in steps) >= 3


def test_deterministic_mode_rows_are_batch_invariant(tiny_model_dir):
    """`deterministic` with the Triton backend (bf16): a prompt's logits rows alone and beside a
    chunked neighbour sharing its prefix are bitwise equal (every token a decode row with the
    fixed partition and config)."""
    from cluster.types import SamplingParams
    from logits_recorder import LogitsRecorder
    prompts = _prompts(shared_prefix=8)
    target, neighbour = prompts[3], prompts[4]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    runs = []
    for batch, budget in (([target], 2048), ([neighbour, target], 12)):
        engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), dtype="bfloat16", attention_backend="triton",
                                        deterministic=True, cache=CacheConfig(block_size=4, num_blocks=128),
                                        scheduler=SchedulerConfig(max_num_batched_tokens=budget)))
        assert engine.backend.invariant
        rec = LogitsRecorder(engine)
        out = engine.generate(batch, sp)[-1]
        engine.pool.check_idle()
        runs.append((rec, list(out.token_ids)))
    (alone, tokens), (batched, batched_tokens) = runs
    assert batched_tokens == tokens
    assert alone.compare(batched, target + tokens) == (4, [])


def test_decode_graph_buffers_on_the_triton_backend(tiny_model_dir):
    """The Triton backend's static decode meta (what a CUDA graph replays), eagerly under the
    interpreter: greedy tokens equal the eager path's."""
    from cluster.types import SamplingParams
    prompts = _prompts()[:3]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = []
    for graphs in ("off", "on"):
        engine = _engine(tiny_model_dir("llama"), cuda_graphs=graphs, max_model_len=64,
                         cache=CacheConfig(block_size=4, num_blocks=128), scheduler=SchedulerConfig(max_num_seqs=4))
        outs.append([o.token_ids for o in engine.generate(prompts, sp)])
        engine.pool.check_idle()
    assert outs[0] == outs[1] and engine.runner.graphs.replays > 0
