"""Speculative decoding's pure parts: the n-gram proposer and the acceptance rules."""
import torch

from decode.spec.acceptance import accept_greedy, accept_sampled
from decode.spec.ngram import NgramProposer


def test_ngram_proposes_what_followed_the_latest_repeat():
    p = NgramProposer(min_n=2, max_n=3)
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7, 4, 2, 6, 7]
    assert p.propose(toks, 3) == [4, 2, 6]        # "6 7" last seen before "4 2 6"
    assert p.propose([1, 2, 3], 3) == []            # no repeat
    assert p.propose(toks, 0) == []


def test_greedy_accepts_the_matching_prefix_plus_one():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 4, 9, 2]):
        logits[i, t] = 1.0
    assert accept_greedy(logits, [3, 4, 5]) == [3, 4, 9]     # rejects 5, target says 9
    assert accept_greedy(logits, [3, 4, 9]) == [3, 4, 9, 2]  # all accepted + bonus
    assert accept_greedy(logits, [1, 4, 9]) == [3]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.10, 0.20])
    n = 20000
    counts = torch.zeros(vocab)
    biased = torch.zeros(vocab)
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=g))
        first = accept_sampled(torch.stack([p, p]), q[None], [x], generator=g)[0]
        counts[first] += 1
        biased[x] += 1          # a broken rule: always accept the draft token
    # 5 degrees of freedom: the 99.9% critical value is 20.5.
    assert _chi_square(counts, p) < 20.5
    assert _chi_square(biased, p) > 20.5


def test_deterministic_proposals_keep_the_target_distribution():
    """n-gram drafts are guesses, not samples: q is one-hot on the guess (as the speculator builds
    it), accepted with probability p(guess), otherwise resampled from p without the guess."""
    from decode.spec.speculator import _one_hot
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    counts = torch.zeros(6)
    always = torch.zeros(6)
    for i in range(20000):
        guess = (1, 3)[i % 2]
        counts[accept_sampled(torch.stack([p, p]), _one_hot((guess,), 6, p.device), [guess], generator=g)[0]] += 1
        always[_accept_every_guess(torch.stack([p, p]), [guess], g)[0]] += 1
    assert _chi_square(counts, p) < 20.5
    assert _chi_square(always, p) > 20.5      # the same test catches a rule that accepts every guess


def _accept_every_guess(target: torch.Tensor, draft: list[int], generator) -> list[int]:
    """A broken acceptance rule, run on the same inputs as the real one: every drafted token is
    kept and the bonus token is drawn from the target's next row."""
    bonus = int(torch.multinomial(target[len(draft)], 1, generator=generator))
    return [*draft, bonus]
