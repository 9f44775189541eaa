"""The Jacobi proposer's bookkeeping: the verification rows after the kept tokens become the next
guesses (aligned to the positions they predict), every row feeds the request's n-gram pool, and
nothing is shared between requests."""
from cluster.config import SpeculativeConfig
from decode.spec.jacobi import JacobiProposer


class Seq:   # the proposer reads token_ids only
    def __init__(self, tokens):
        self.token_ids = list(tokens)


def test_rows_after_the_kept_tokens_are_the_next_guesses():
    jac = JacobiProposer(SpeculativeConfig(ngram_min=2, ngram_max=4))
    seq = Seq([1, 2, 3, 4])
    # Draft (10, 11, 12): the target keeps 10 (accepted) and its own 20; rows 2 and 3 predicted 21, 22
    # after the rejected guess 11 and then 12: the refined guesses for the next two positions.
    jac.observe(seq, seq.token_ids, (10, 11, 12), [10, 20, 21, 22], kept=2)
    seq.token_ids += [10, 20]
    # The pool knows (4, 10) -> 20 and (10, 11) -> 21, (11, 12) -> 22; (10, 20) is unknown, so the
    # guesses fill in, and then the pool continues from them when it can.
    assert jac.draft(seq, 2) == [21, 22]
    assert jac.states[seq].pool[(4, 10)] == 20 and jac.states[seq].pool[(3, 4)] == 10


def test_pool_lookups_chain_and_stale_guesses_are_ignored():
    jac = JacobiProposer(SpeculativeConfig())
    seq = Seq([5, 6, 7])
    jac.observe(seq, seq.token_ids, (8, 9), [8, 9, 30], kept=3)   # all accepted: (6,7)->8, (7,8)->9, (8,9)->30
    seq.token_ids += [8, 9, 30]
    assert jac.draft(seq, 3) == []   # no pool key for (9, 30), no guess left, no repeat for prompt lookup
    seq.token_ids += [6, 7]          # history repeats: the pool chains 8, 9, 30
    assert jac.draft(seq, 3) == [8, 9, 30]
    other = Seq([6, 7])
    assert jac.draft(other, 3) == []   # another request: none of this one's pool
    jac.release(seq)
    assert seq not in jac.states
