"""The engine's n > 1 samples (forks) and prompt logprobs.

Forks: the prompt is computed once (the prompt-token counter says so, prefix caching off), each
sample equals the same request run alone with its own seed, the pool ends empty, and every path
that does not get to share (an abort before the first sampling, no block free for the copy of the
partial block) still ends cleanly. Prompt logprobs equal transformers' log-softmax of the same
checkpoint, whatever the chunking, and are not lost to a prefix-cache hit.
"""
from __future__ import annotations

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.types import FinishReason, Fork, SamplingParams


def _engine(model_dir, prefix_caching=False, num_blocks=128, budget=2048, block_size=4) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype="float32", kernels="torch",
                                  cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                    enable_prefix_caching=prefix_caching),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def _prompt(n: int, seed: int = 3) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine) -> dict[str, list]:
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
    return out


def _tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return _engine(tiny_model_dir("llama"))


@pytest.mark.parametrize("length", [13, 16])     # a partial last block (copied), and none
def test_forks_compute_the_prompt_once_and_equal_separate_runs(engine, length):
    prompt = _prompt(length)
    seeds = [11, 12, 13]
    alone = [list(engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=s))[0].token_ids)
             for s in seeds]
    greedy = list(engine.generate([prompt], SamplingParams(max_tokens=12))[0].token_ids)
    before = engine.prompt_tokens_computed
    engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=seeds[0]), "s0",
                       forks=[Fork("s1", SamplingParams(max_tokens=12, temperature=1.0, seed=seeds[1])),
                              Fork("s2", SamplingParams(max_tokens=12, temperature=1.0, seed=seeds[2])),
                              Fork("g", SamplingParams(max_tokens=12))])
    out = _run(engine)
    assert engine.prompt_tokens_computed - before == length     # once, not four times
    assert [_tokens(out[r]) for r in ("s0", "s1", "s2")] == alone
    assert _tokens(out["g"]) == greedy
    assert len({tuple(a) for a in alone}) == 3                   # the samples differ from each other
    engine.pool.check_idle()


def test_a_fork_that_stops_at_its_first_token_and_one_without_a_free_block(tiny_model_dir):
    prompt = _prompt(10)
    # A pool that holds the parent (3 blocks of 4) and one more block: one fork gets the copy of
    # the partial block, the next must compute the prompt itself (when blocks come back).
    engine = _engine(tiny_model_dir("llama"), num_blocks=4)
    greedy = list(engine.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids)
    first = greedy[0]
    shared = []
    fork = engine.scheduler.fork
    engine.scheduler.fork = lambda *a: shared.append(fork(*a)) or shared[-1]
    engine.add_request(prompt, SamplingParams(max_tokens=6), "p",
                       forks=[Fork("stops", SamplingParams(max_tokens=6, stop_token_ids=(first,))),
                              Fork("a", SamplingParams(max_tokens=6)), Fork("b", SamplingParams(max_tokens=6))])
    out = _run(engine)
    assert _tokens(out["stops"]) == [first] and out["stops"][-1].finish_reason is FinishReason.STOP
    assert _tokens(out["p"]) == _tokens(out["a"]) == _tokens(out["b"]) == greedy
    assert shared == [True, False]
    engine.pool.check_idle()


def test_aborting_the_parent_before_its_first_token_ends_its_forks(engine):
    engine.add_request(_prompt(20), SamplingParams(max_tokens=5), "p", forks=[Fork("f", SamplingParams(max_tokens=5))])
    assert engine.abort("p")
    out = _run(engine)
    assert out["p"][-1].finish_reason is FinishReason.ABORT and out["f"][-1].finish_reason is FinishReason.ABORT
    assert _tokens(out["f"]) == []
    engine.pool.check_idle()


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()

    def ref(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return ref


@pytest.mark.parametrize("budget", [2048, 7])     # one pass, and chunks of 7 tokens
def test_prompt_logprobs_equal_transformers(tiny_model_dir, hf_logprobs, budget):
    prompt = _prompt(30, seed=5)
    ref = hf_logprobs(prompt)
    engine = _engine(tiny_model_dir("llama"), prefix_caching=True, budget=budget)
    for attempt in range(2):      # the second time the prompt is cached: its logprobs still come
        engine.add_request(prompt, SamplingParams(max_tokens=3, prompt_logprobs=3), f"r{attempt}")
        out = _run(engine)[f"r{attempt}"]
        got = [d.prompt_logprobs for d in out if d.prompt_logprobs]
        assert len(got) == 1 and len(got[0]) == len(prompt) - 1     # once; the first token has none
        for i, lp in enumerate(got[0]):
            assert lp.token_id == prompt[i + 1]
            assert abs(lp.logprob - float(ref[i, prompt[i + 1]])) < 1e-4
            assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()
    engine.pool.check_idle()
