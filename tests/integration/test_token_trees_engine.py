"""Token-tree verification through the engine: trees whose right continuation sits anywhere in
them (behind wrong siblings, as a leaf, under a wrong branch) give exactly the tokens of plain
decoding, on every attention path (the C kernel's tree rows, the deterministic mode's every-row
pass, the torch reference's masks, an int8 KV cache), the accepted path's K/V lands where plain
decoding would have written it, and every block comes back. Then quantspec's own trees."""
import random

import pytest

from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig
from cluster.engine import draft_tree
from cluster.engine.engine import LLMEngine
from cluster.engine.speculation import Draft
from cluster.types import SamplingParams
from decode.spec.speculator import make_speculator

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    def __init__(self, path):\n",
           "for i in range(10):\n    print(i)\n", "class Stack:\n    def push(self, item):\n"]
MAX_TOKENS = 32


class OracleTrees:
    """Knows plain decoding's answer and hides it in random trees of at most k tokens: a wrong
    sibling before the right token (with a child of its own), the right token as a leaf beside a
    wrong chain, or a wrong token that ends the path early."""
    method = "ngram"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int):
        self.answers, self.vocab, self.rng = answers, vocab, random.Random(0)
        self.moved = 0     # accepted nodes that sat away from their position's slot

    def propose(self, seqs, ks, stop_rules):
        return [self._tree(self.answers[tuple(s.prompt_token_ids)][s.num_output_tokens:], k) for s, k in zip(seqs, ks)]

    def _wrong(self, tok: int) -> int:
        return (tok + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab

    def _tree(self, right: list[int], k: int) -> Draft:
        tokens, parents, at = [], [], -1
        for tok in right:
            if len(tokens) >= k:
                break
            if self.rng.random() < 0.15:          # the path ends here: the target's own token follows
                tokens.append(self._wrong(tok))
                parents.append(at)
                break
            if self.rng.random() < 0.5 and len(tokens) + 2 <= k:
                tokens.append(self._wrong(tok))
                parents.append(at)
                if self.rng.random() < 0.5 and len(tokens) + 2 <= k:
                    tokens.append(self.rng.randrange(self.vocab))
                    parents.append(len(tokens) - 2)
            tokens.append(tok)
            parents.append(at)
            at = len(tokens) - 1
        draft_tree.check(tuple(tokens), tuple(parents))
        path = draft_tree.path(tuple(parents), at) if at >= 0 else []
        self.moved += sum(node != j for j, node in enumerate(path))
        return Draft(tuple(tokens), parents=tuple(parents))

    def release(self, seq):
        pass


def _config(**kw):
    return EngineConfig(num_threads=2, **kw)


@pytest.mark.parametrize("case", [
    dict(), dict(deterministic=True), dict(kernels="torch"), dict(cache=CacheConfig(kv_cache_dtype="int8"))],
    ids=["default", "deterministic", "torch-reference", "int8-kv"])
def test_oracle_trees_give_plain_decoding(case):
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    plain = LLMEngine(_config(**case))
    want = [c.token_ids for c in plain.generate(PROMPTS, sampling)]
    engine = LLMEngine(_config(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=6), **case),
                       speculator_factory=make_speculator)
    oracle = OracleTrees({tuple(plain.tokenize(p)): w for p, w in zip(PROMPTS, want)}, plain.model_config.vocab_size)
    engine.speculator.proposers["ngram"] = oracle
    got = engine.generate(PROMPTS, sampling)
    assert [c.token_ids for c in got] == want
    stats = engine.speculator.stats()["ngram"]
    assert stats["emitted"] / stats["steps"] > 2.0, "the trees' right paths were not accepted"
    assert oracle.moved > 10, "no accepted node sat away from its slot: compaction went untested"
    engine.pool.check_idle()


@pytest.mark.parametrize("method,k,case", [("quantspec", 3, {}), ("quantspec", "auto", {}), ("eagle", 3, {}),
                                           ("eagle", 3, {"deterministic": True})])
def test_model_drafters_grow_trees_and_keep_plain_decoding(method, k, case):
    """The drafter's runner-up leaves (a budget and no minimum gain, so most steps have some); the
    EAGLE head also runs over the tree's rows and keeps the accepted path's features. A sampled
    request in the batch keeps chains (with `auto`, its draft may stop short of its room)."""
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    want = [c.token_ids for c in LLMEngine(_config(**case)).generate(PROMPTS, sampling)]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, spec_tree_budget=4, spec_tree_min_gain=0.0)
    engine = LLMEngine(_config(speculative=spec, **case), speculator_factory=make_speculator)
    got = engine.generate(PROMPTS, [sampling, sampling, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=1),
                                    SamplingParams(max_tokens=MAX_TOKENS, logprobs=2)])
    assert [got[i].token_ids for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
    stats = engine.speculator.stats()[method]
    # With `auto`, whether leaves pay is measured first (step_policy.py): a short run may never try them.
    assert stats["tree_drafted"] > 0 or k == "auto", "no leaf was verified"
    if method == "eagle":   # its head is unsure often enough that leaves get accepted (7 of 44 here)
        assert stats["tree_accepted"] > 0, "no leaf was accepted: the leaf path's features went untested"
    assert len(got[3].logprobs) == MAX_TOKENS
    engine.pool.check_idle()


def test_ngram_trees_equal_plain_decoding():
    """Prompt lookup's other occurrences become branches (a history that continued several ways)."""
    prompt = "x = f(a)\ny = f(b)\nz = f(c)\nx = g(a)\ny = g(b)\nz = g(c)\nx = "
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    want = [c.token_ids for c in LLMEngine(_config()).generate([prompt, *PROMPTS[:2]], sampling)]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, spec_tree_budget=6)
    engine = LLMEngine(_config(speculative=spec), speculator_factory=make_speculator)
    got = engine.generate([prompt, *PROMPTS[:2]], sampling)
    assert [c.token_ids for c in got] == want
    assert engine.speculator.stats()["ngram"]["tree_drafted"] > 0, "no branch was verified"
    engine.pool.check_idle()
