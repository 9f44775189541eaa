"""The engine on a quantized KV cache (`--kv-cache-dtype int8|fp8_e4m3`).

Quality on the default model: against the same engine with an unquantized cache, greedy tokens
agree on most chat prompts for int8 (at most 2 of 8 may diverge) and on some for fp8's 3 mantissa
bits (at most 6 of 8), the mismatches counted in the message; before a divergence the chosen
tokens' logprobs stay within 0.5. Measured on a Zen 3 over 24 tokens: int8 0 of 8 diverge (largest
logprob change 0.22), fp8 4 of 8 (at tokens 0, 6, 13 and 23; 0.34). The rest is exact: the prefix cache reuses quantized blocks
(the same tokens as the first run); in deterministic mode a request's tokens do not depend on
its batch or its prefill chunking; n-gram speculation leaves greedy output unchanged; a pool too
small for the batch preempts and recomputes into fresh int8 blocks with the same tokens; pools end
empty. (Kernel-level exactness: tests/unit/test_kv_quant.py.)"""
from __future__ import annotations

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, default_model_dir
from cluster.engine.engine import LLMEngine
from cluster.types import FinishReason, SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain why the sky is blue in two sentences.", "Who wrote Romeo and Juliet?", "What is 12 times 7?",
             "Give me a tip for learning Python.", "What does a CPU do?"]


def _engine(kv: str, model=None, **kw) -> LLMEngine:
    model_kw = {} if model is None else {"model": model}
    cache = CacheConfig(num_blocks=kw.pop("num_blocks", 256), kv_cache_dtype=kv)
    return LLMEngine(EngineConfig(**model_kw, num_threads=2, cache=cache, **kw))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.fixture(scope="module")
def unquantized_answers():
    engine = _engine("auto", model=default_model_dir(), dtype="float32")
    prompts = [engine.tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
               for q in QUESTIONS]
    return prompts, engine.generate(prompts, SamplingParams(max_tokens=24, logprobs=0))


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_kv_tracks_the_unquantized_engine(unquantized_answers, kv):
    prompts, want = unquantized_answers
    engine = _engine(kv, model=default_model_dir(), dtype="float32")
    assert engine.kv_cache.arena.shape[-1] == engine.model_config.head_dim + 2
    got = engine.generate(prompts, SamplingParams(max_tokens=24, logprobs=0))
    engine.pool.check_idle()
    diverged = {i: _first_difference(g.token_ids, w.token_ids) for i, (g, w) in enumerate(zip(got, want))
                if g.token_ids != w.token_ids}
    allowed = {"int8": 2, "fp8_e4m3": 6}[kv]
    assert len(diverged) <= allowed, f"{kv}: greedy differs on {len(diverged)} of 8 (prompt: token) {diverged}"
    worst = max(abs(a.logprob - b.logprob) for i, (g, w) in enumerate(zip(got, want))
                for a, b in list(zip(g.logprobs, w.logprobs))[:diverged.get(i) or len(w.logprobs)])
    assert worst <= 0.5, f"{kv}: chosen-token logprobs differ by up to {worst:.3f} before any divergence"


def test_prefix_cache_reuses_quantized_blocks(tiny_model_dir):
    engine = _engine("int8", model=tiny_model_dir("llama"))
    prompt = list(range(5, 5 + 70))
    first = engine.generate([prompt], SamplingParams(max_tokens=10))[0]
    again = engine.generate([prompt], SamplingParams(max_tokens=10))[0]
    assert again.num_cached_tokens == 64 and first.num_cached_tokens == 0
    assert again.token_ids == first.token_ids
    engine.pool.check_idle()


def test_deterministic_mode_keeps_its_guarantee_on_int8_kv(tiny_model_dir):
    """Every token is a decode row reading the quantized cache: batch and chunking do not matter."""
    model = tiny_model_dir("llama")
    whole = _engine("int8", model=model, dtype="bfloat16", deterministic=True)
    chunked = _engine("int8", model=model, dtype="bfloat16", deterministic=True,
                      scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 200, (int(n),), generator=g).tolist() for n in (9, 40, 75, 23)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    together = whole.generate(prompts, params)
    for p, t in zip(prompts, together):
        assert whole.generate([p], params)[0].token_ids == t.token_ids
    assert [o.token_ids for o in chunked.generate(prompts, params)] == [t.token_ids for t in together]
    whole.pool.check_idle()
    chunked.pool.check_idle()


def test_ngram_speculation_on_int8_kv_equals_plain_decoding(tiny_model_dir):
    from decode.spec.speculator import make_speculator  # noqa: PLC0415
    model = tiny_model_dir("llama")
    plain = _engine("int8", model=model, dtype="float32")
    spec = LLMEngine(EngineConfig(model=model, num_threads=2, dtype="float32",
                                  cache=CacheConfig(num_blocks=256, kv_cache_dtype="int8"),
                                  speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4)),
                     speculator_factory=make_speculator)
    prompts = [[7, 8, 9, 10, 11] * 6, [20, 21, 22, 23] * 8 + [5]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    spec.pool.check_idle()


def test_quantspec_drafts_over_the_targets_int8_cache_and_changes_no_token():
    """QuantSpec's hierarchical cache: the 4-bit draft reads the target's own int8 KV through its
    int4 view (no KV of its own: its footprint is its 4-bit weights) and greedy output equals plain
    decoding on the same cache, token for token (deterministic mode: a verification row is the
    decode row of its token)."""
    from decode.spec.speculator import make_speculator  # noqa: PLC0415
    kw = {"model": default_model_dir(), "dtype": "bfloat16", "deterministic": True}
    plain = _engine("int8", **kw)
    prompts = [plain.tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
               for q in QUESTIONS[:3]]
    params = SamplingParams(max_tokens=24)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    del plain
    spec = LLMEngine(EngineConfig(num_threads=2, cache=CacheConfig(num_blocks=256, kv_cache_dtype="int8"),
                                  speculative=SpeculativeConfig(method="quantspec", num_speculative_tokens=3,
                                                                quantspec_kv_view="int4"), **kw),
                     speculator_factory=make_speculator)
    proposer = spec.speculator.proposers["quantspec"]
    assert proposer.int4_view and proposer.passes.runner.kv_arena is spec.kv_cache.arena
    assert spec.speculator.models.footprint.bytes_per_block == 0
    # Every draft linear is 4-bit on int8 activations, the LM head 8-bit; the embedding is the target's.
    from cluster.model.quant_linear import QuantLinear  # noqa: PLC0415
    linears = [m for m in proposer.model.modules() if isinstance(m, QuantLinear) and m is not proposer.model.lm_head]
    assert all(m.act_int8 and m.qweight.format.value in ("q4_0", "q4_1") for m in linears)
    assert proposer.model.lm_head.qweight.format.value == "q8_0"
    assert proposer.model.embed_tokens is spec.model.embed_tokens
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    counts = spec.speculator.stats()["quantspec"]
    assert counts["steps"] > 0 and counts["accepted"] > 0, counts
    spec.pool.check_idle()


def test_the_int4_view_needs_an_int8_cache(tiny_model_dir):
    from decode.spec.speculator import make_speculator  # noqa: PLC0415
    with pytest.raises(ValueError, match="needs --kv-cache-dtype int8 .this engine's is auto"):
        LLMEngine(EngineConfig(model=tiny_model_dir("llama"), num_threads=2, cache=CacheConfig(num_blocks=64),
                               speculative=SpeculativeConfig(method="quantspec", quantspec_kv_view="int4")),
                  speculator_factory=make_speculator)


@pytest.mark.parametrize("method", ["off", "ngram"])
def test_preemption_on_int8_kv_keeps_greedy_tokens_and_frees_the_pool(tiny_model_dir, method):
    """Six concurrent requests of up to 6 blocks each on a pool of 12: the scheduler preempts
    (frees a request's int8 blocks and recomputes its prompt and tokens so far into fresh ones,
    partly from the prefix cache), and every request still yields the tokens of the same engine
    with room for all, whose scheduler never preempts. With n-gram drafts (n from 1: a draft on
    most steps, few accepted), their lookahead blocks come and go with the preemptions too, and the
    tokens still equal plain decoding's. The pool ends empty."""
    from decode.spec.speculator import make_speculator  # noqa: PLC0415
    model = tiny_model_dir("llama")

    def engine(num_blocks: int, method: str) -> LLMEngine:
        spec = SpeculativeConfig(method=method, num_speculative_tokens=4, ngram_min=1)
        return LLMEngine(EngineConfig(model=model, num_threads=2, dtype="float32", speculative=spec,
                                      cache=CacheConfig(num_blocks=num_blocks, kv_cache_dtype="int8")),
                         speculator_factory=make_speculator if method != "off" else None)

    g = torch.Generator().manual_seed(5)
    # Each prompt a random run of 7 to 12 tokens, three times over (21 to 36 tokens).
    prompts = [torch.randint(5, 300, (int(n),), generator=g).tolist() * 3 for n in (7, 9, 11, 8, 10, 12)]
    params = SamplingParams(max_tokens=56, ignore_eos=True)
    roomy, tight = engine(256, "off"), engine(12, method)
    want = roomy.generate(prompts, params)
    assert roomy.scheduler.num_preemptions == 0
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0, "the small pool never preempted: the test proves nothing"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.token_ids) == 56 and o.finish_reason == FinishReason.LENGTH for o in got)
    if method == "ngram":
        counts = tight.speculator.stats()["ngram"]
        assert counts["steps"] > 0 and counts["accepted"] > 0, counts
    tight.pool.check_idle()
    assert tight.pool.num_free == 12
    roomy.pool.check_idle()
