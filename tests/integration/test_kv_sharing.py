"""Cross-layer KV sharing (Gemma 4 text, `num_kv_shared_layers`) through the engine in float32, on
tiny random checkpoints (tests/tiny_models.py GEMMA4_KINDS; the sharing one with per-layer inputs,
the other without): greedy tokens equal transformers' and
log-probabilities follow them, through chunked prefill and the prefix cache, on torch ops and on the
fused C kernels; the layers that share hold no KV (the arena has 3 layers of 6, a block half the
bytes); a P/D handoff (the real workers, loopback transport) moves that half; the same model
without sharing still equals transformers; what the model code lacks is refused by name."""
from __future__ import annotations

import asyncio
import json

import pytest
from integration.test_model_families import _fused_plan, family_prompts
from loopback_pair import connect, loopback_pair

from cluster.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from cluster.engine.engine import LLMEngine
from cluster.model.gemma4_config import kv_source_layers
from cluster.model.model_config import parse_model_config
from cluster.types import SamplingParams
from cluster.worker_messages import DecodeCall, PrefillCall
from kernels import cpu_ops

MAX_TOKENS = 12
# 2 KV heads x 16 dims x 4 bytes, K and V, 4-token blocks: 1,024 bytes a layer.
LAYER_BYTES = 2 * 4 * 2 * 16 * 4


@pytest.fixture
def reference(hf_reference):
    """conftest's session reference (transformers' greedy tokens and log-probabilities) at MAX_TOKENS."""
    return lambda kind, prompt: hf_reference(kind, prompt, MAX_TOKENS)


def _check(engine: LLMEngine, kind: str, prompts, reference) -> list:
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, logprobs=0))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = reference(kind, prompt)
        assert list(out.token_ids) == tokens, f"{kind}: prompt of {len(prompt)} tokens"
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=1e-4), kind
    engine.pool.check_idle()
    return outs


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", cache=CacheConfig(block_size=4, num_blocks=256),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=9), **kw))


@pytest.mark.parametrize("kind", ["gemma4", "gemma4_unshared"])
def test_torch_ops_chunked_with_prefix_hits(kind, tiny_model_dir, reference):
    """Prefill chunks of at most 9 tokens beside decodes (past the window of 8), then prompts that
    start from 12 cached tokens; the arena holds the owning layers only."""
    engine = _engine(tiny_model_dir(kind), kernels="torch")
    owners = 3 if kind == "gemma4" else 6
    assert engine.kv_cache.arena.shape[0] == engine.layout.num_layers == owners
    assert engine.layout.bytes_per_block() == owners * LAYER_BYTES
    assert engine.kv_cache.nbytes() == 256 * owners * LAYER_BYTES
    prompts = family_prompts(shared_prefix=12, lengths=(3, 13, 30))
    _check(engine, kind, prompts[:1], reference)
    outs = _check(engine, kind, prompts[1:], reference)
    assert all(o.num_cached_tokens >= 12 for o in outs), [o.num_cached_tokens for o in outs]


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler: fused CPU ops not built")
def test_fused_kernels(tiny_model_dir, reference):
    """The C kernels: in-place RoPE and norms, the C prefill, the fused decode block for the
    owning layers and the C decode attention (reading the source's cache) for the sharing ones."""
    engine = _engine(tiny_model_dir("gemma4"), kernel_plan=_fused_plan())
    _check(engine, "gemma4", family_prompts(lengths=(13, 30)), reference)


def test_ngram_verifications(tiny_model_dir, reference):
    """Speculative n-gram drafts verified through the sharing layers (verification spans over the
    source's cache, nothing stored by the sharing layers) still give transformers' greedy tokens."""
    from cluster.config import SpeculativeConfig
    from decode.spec.speculator import make_speculator
    engine = LLMEngine(EngineConfig(model=tiny_model_dir("gemma4"), dtype="float32", kernels="torch",
                                    cache=CacheConfig(block_size=4, num_blocks=128),
                                    speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                  ngram_min=1)),
                       speculator_factory=make_speculator)
    _check(engine, "gemma4", [list(range(3, 203))], reference)   # most of the vocabulary: tokens to match
    assert engine.speculator.stats()["ngram"]["drafted"] > 0


def test_which_layer_reads_which(tiny_model_dir):
    import transformers
    cfg = parse_model_config(json.loads((tiny_model_dir("gemma4") / "config.json").read_text()), model_id="g")
    assert cfg.kv_source_layer == (0, 1, 2, 1, 2, 1) and cfg.num_kv_layers == 3
    assert cfg.kv_arena_layers() == (0, 1, 2, 1, 2, 1)
    assert [cfg.layer_intermediate_size(i) for i in range(6)] == [128] * 3 + [256] * 3   # double-wide
    assert cfg.rope.kind == "proportional" and cfg.rope.partial == 0.5 and cfg.attention_scale == 1.0
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (8, 384)
    # transformers' own rule on its default layer pattern (5 sliding : 1 full), 30 layers, 20 shared.
    hf = transformers.Gemma4TextConfig(num_hidden_layers=30, num_kv_shared_layers=20)
    modes, ours = hf.kv_sharing_modes, kv_source_layers(tuple(hf.layer_types), 20)
    stores = {hf.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    assert ours == tuple(stores[hf.layer_types[i]] if m == "reuse" else i for i, m in enumerate(modes))


def test_tensor_parallelism_refuses_sharing(tiny_model_dir):
    """Refused before any weight is sliced (a sharing layer's query-only projection is not)."""
    from cluster.parallel.sharding import shard_model
    cfg = parse_model_config(json.loads((tiny_model_dir("gemma4") / "config.json").read_text()), model_id="g")
    with pytest.raises(ValueError, match=r"cross-layer KV sharing \(num_kv_shared_layers\) .* tensor parallelism"):
        shard_model(None, cfg, None)


@pytest.mark.parametrize("changes, named", [
    ({"per_layer_config": {"5": {"head_dim": 32}}}, r"per-layer attention sizes \(layer 5: head_dim 32"),
    ({"per_layer_config": None}, r"layer 1: head_dim 512.*global_head_dim"),   # transformers' default
    ({"attention_k_eq_v": True}, r"keys reused as values \(attention_k_eq_v\)"),
    ({"enable_moe_block": True}, r"mixture-of-experts block \(enable_moe_block\)"),
    ({"num_kv_shared_layers": 6}, r"num_kv_shared_layers \(6\) leaves no layer computing K/V"),
    ({"architectures": ["Gemma3nForCausalLM"]}, r"Gemma 3n .*AltUp, LAuReL"),
    ({"architectures": ["Gemma4ForConditionalGeneration"]}, r"Gemma 4 multimodal"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, r"RoPE scaling 'yarn'"),
])
def test_unsupported_features_are_refused_by_name(changes, named, tiny_model_dir):
    raw = json.loads((tiny_model_dir("gemma4") / "config.json").read_text())
    raw.update(changes)
    if raw.get("per_layer_config") is None:
        raw.pop("per_layer_config")
    with pytest.raises(ValueError, match=named):
        parse_model_config(raw, model_id="g")


def test_handoff_moves_only_the_owning_layers(tiny_model_dir, reference):
    """Prefill worker to decode worker (loopback transport): the decode worker continues the
    prompt as transformers does, and the handoff moved 10 blocks of 3 layers, not 6."""
    prompt = family_prompts(lengths=(40,))[0]
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def go(prefill, decode) -> list[int]:
        receiver = await connect(prefill, decode)
        try:
            result = await prefill.prefill(PrefillCall("r", prompt, sampling))
            key, queue = receiver.open("r")
            call = asyncio.ensure_future(decode.decode(DecodeCall("r", prompt, sampling, result.handle,
                                                                  receiver.address, key)))
            tokens, done = list(result.first.token_ids), False
            while not done:
                for d in await queue.take():
                    tokens.extend(d.token_ids)
                    done = done or d.finish_reason is not None
            await call
            return tokens
        finally:
            await receiver.stop()
    with loopback_pair(tiny_model_dir("gemma4"), block_size=4) as (prefill, decode):
        tokens = asyncio.run(go(prefill, decode))
        stats = decode.stats().handoff
    assert stats.done == 1 and stats.bytes == 10 * 3 * LAYER_BYTES, stats
    assert tokens == reference("gemma4", prompt)[0]
