"""Speculative decoding through the engine: greedy output is unchanged token for token, sampled
output keeps the target's distribution, and every block comes back on every path."""
import math

import pytest
import torch

import decode.spec.speculator as speculator_module
from cluster.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.types import FinishReason, SamplingParams
from decode.spec.speculator import make_speculator

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "for i in range(10):\n    print(i)\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "class Stack:\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
]
MAX_TOKENS = 40


def spec_engine(method, k=4, **engine_kw):
    config = EngineConfig(num_threads=2, speculative=SpeculativeConfig(method=method, num_speculative_tokens=k),
                          **engine_kw)
    return LLMEngine(config, speculator_factory=make_speculator)


def pools_idle(engine):
    engine.pool.check_idle()
    for proposer in engine.speculator.proposers.values():
        pool = getattr(proposer, "pool", None)
        if pool is not None:
            assert pool.num_used == 0, f"{proposer.method} proposer still holds {pool.num_used} blocks"


@pytest.fixture(scope="module")
def reference():
    """The default model is bf16, where only the deterministic mode promises that a verification
    row equals the decode row of the same token: otherwise the linears' kernel follows the step's
    row count (on an AVX2 CPU the plan runs up to 8 rows through the C kernel, more through BLAS),
    and greedy output may part after a few dozen tokens (README: what is guaranteed)."""
    engine = LLMEngine(EngineConfig(num_threads=2, deterministic=True))
    return [c.token_ids for c in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]


def mean_accepted_length(engine, method):
    c = engine.speculator.stats()[method]
    assert c["steps"] > 0, f"{method}: no verification step ran (a silent fallback to plain decoding)"
    return c["emitted"] / c["steps"]


@pytest.mark.parametrize("method,k", [("ngram", 4), ("ngram", "auto"), ("jacobi", 4), ("jacobi", "auto"),
                                      ("draft", 3), ("draft", "auto"),
                                      ("eagle", 3), ("eagle", "auto"), ("quantspec", "auto")])
def test_greedy_output_unchanged_in_mixed_batches(method, k, reference):
    engine = spec_engine(method, k, deterministic=True)
    # One batch mixes the engine's default k, per-request k, speculation off, and a sampled request.
    sampling = [SamplingParams(max_tokens=MAX_TOKENS),
                SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=2),
                SamplingParams(max_tokens=MAX_TOKENS, speculative="off"),
                SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=6),
                SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens="auto"),
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3)]
    out = engine.generate([*PROMPTS, PROMPTS[0]], sampling)
    assert [c.token_ids for c in out[:5]] == reference
    assert len(out[5].token_ids) == MAX_TOKENS
    assert mean_accepted_length(engine, method) > 1.0
    pools_idle(engine)


def test_stop_strings_and_eos_inside_accepted_drafts():
    plain = LLMEngine(EngineConfig(num_threads=2))
    engine = spec_engine("ngram", 6)
    for sp in (SamplingParams(max_tokens=40, stop=("self.",)), SamplingParams(max_tokens=40, stop=("):",)),
               SamplingParams(max_tokens=40, stop_token_ids=(plain.tokenize("    ")[-1],))):
        want = plain.generate(PROMPTS[1:4], sp)
        got = engine.generate(PROMPTS[1:4], sp)
        assert [(c.token_ids, c.text, c.finish_reason) for c in got] == \
               [(c.token_ids, c.text, c.finish_reason) for c in want]
    pools_idle(engine)


@pytest.mark.parametrize("method", ["draft", "quantspec"])
def test_pools_return_after_rejections_aborts_and_preemption(method):
    # A small cache forces preemption while drafts hold lookahead blocks; k=8 with the
    # data-only draft makes most drafts fail. QuantSpec drafts into the target's own blocks.
    engine = spec_engine(method, 8, cache=CacheConfig(num_blocks=40, block_size=8))
    start_free = engine.pool.num_free
    ids = [engine.add_request(p * 3, SamplingParams(max_tokens=64, ignore_eos=True)) for p in PROMPTS]
    ended = {}
    for step in range(400):
        for d in engine.step():
            if d.finished:
                ended[d.request_id] = d.finish_reason
        if step == 6:
            for rid in ids[:2]:
                engine.abort(rid)
        if not engine.has_unfinished():
            break
    assert set(ended) == set(ids)
    assert [ended[r] for r in ids[:2]] == [FinishReason.ABORT] * 2
    assert engine.scheduler.num_preemptions > 0
    counts = engine.speculator.stats()[method]
    assert counts["drafted"] > (counts["accepted"] if method == "draft" else 0)
    assert engine.pool.num_free == start_free
    pools_idle(engine)


def _contingency_chi_square(a: dict, b: dict) -> tuple[float, int]:
    """Two-sample chi-square over categories, pooling those with few observations."""
    keys = sorted(set(a) | set(b), key=lambda t: -(a.get(t, 0) + b.get(t, 0)))
    na, nb = sum(a.values()), sum(b.values())
    rows, rest = [], [0, 0]
    for key in keys:
        ca, cb = a.get(key, 0), b.get(key, 0)
        if ca + cb >= 20:
            rows.append((ca, cb))
        else:
            rest[0] += ca
            rest[1] += cb
    if sum(rest):
        rows.append(tuple(rest))
    stat = 0.0
    for ca, cb in rows:
        total = ca + cb
        for observed, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


def _critical(df: int, z: float = 3.09) -> float:
    """Chi-square quantile at 1 - 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _second_tokens(engine, n):
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=i) for i in range(n)]
    counts = {}
    for c in engine.generate(["def add(a, b):"] * n, sp):
        counts[c.token_ids[1]] = counts.get(c.token_ids[1], 0) + 1
    return counts


def test_speculative_sampling_keeps_the_target_distribution(tiny_model_dir, monkeypatch):
    from tiny_models import make_model
    target = tiny_model_dir("llama")
    draft = make_model(target.parent / "draft-seed1", "llama", seed=1)
    sched = SchedulerConfig(max_num_seqs=256)
    plain = LLMEngine(EngineConfig(model=target, num_threads=1, seed=1, scheduler=sched))
    spec = LLMEngine(EngineConfig(model=target, num_threads=1, seed=2, scheduler=sched,
                                  speculative=SpeculativeConfig(method="draft", draft_model=draft,
                                                                num_speculative_tokens=3)),
                     speculator_factory=make_speculator)
    n = 800
    reference = _second_tokens(plain, n)
    stat, df = _contingency_chi_square(reference, _second_tokens(spec, n))
    assert spec.speculator.stats()["draft"]["steps"] >= n
    assert stat < _critical(df), f"chi-square {stat:.1f} with {df} degrees of freedom"

    def always_accept(target_probs, draft_probs, proposal, generator=None):
        return [*proposal, int(torch.multinomial(target_probs[len(proposal)], 1, generator=generator))]
    monkeypatch.setattr(speculator_module, "accept_sampled", always_accept)
    stat, df = _contingency_chi_square(reference, _second_tokens(spec, n))
    assert stat > _critical(df), f"a biased rule passed: chi-square {stat:.1f} with {df} degrees of freedom"


def test_eagle_mechanics_with_prefix_hits_and_preemption(tmp_path, tiny_model_dir):
    """Any head (here an untrained one, for a tiny fp32 target) leaves greedy output unchanged: on
    prefix-cache hits (the head continues from the feature kept for the hit's last block) and
    under preemption."""
    from decode.spec.heads.eagle import EagleConfig, EagleHead, save_eagle_head
    target = tiny_model_dir("llama")
    head = EagleHead(EagleConfig.from_target(str(target), intermediate_size=128))
    head.init_weights(seed=0, std=0.2)
    save_eagle_head(head, str(tmp_path / "head"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 12, 17, 30)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [c.token_ids for c in LLMEngine(EngineConfig(model=target, num_threads=1)).generate(prompts, sp)]
    for cache in (CacheConfig(block_size=4), CacheConfig(num_blocks=20, block_size=4)):
        engine = LLMEngine(EngineConfig(model=target, num_threads=1, cache=cache, speculative=SpeculativeConfig(
            method="eagle", eagle_head=tmp_path / "head", num_speculative_tokens=3)), speculator_factory=make_speculator)
        for _ in range(2):   # the second round starts from prefix-cache hits
            assert [c.token_ids for c in engine.generate(prompts, sp)] == want
        assert engine.speculator.stats()["eagle"]["steps"] > 0
        if cache.num_blocks is None:
            assert engine.pool.hits > 0
        pools_idle(engine)
