"""Jacobi lookahead proposer: training-free drafts for any model, from the target's own
verification rows.

Jacobi decoding treats the next k tokens as a fixed point: guess them, run the target over the
guesses in one pass, and replace each guess by the target's argmax after the guesses before it;
iterate until nothing changes. Lookahead decoding (Fu et al., 2024) adds an n-gram pool gathered
from those trajectories, since the target's predictions under wrong guesses are often right a few
tokens later. Here the verification pass is the Jacobi iteration, so it costs no pass of its own:
 - the rows after the first rejected draft token are the target's predictions conditioned on the
   guess there; they become the next step's guesses for the positions after the corrected token
   (the refined iterate), continued by the pool;
 - every row also gives an n-gram, (the n-1 tokens it was conditioned on) -> (its argmax), which
   goes into the request's pool. A proposal starts with prompt lookup (ngram.py: a repeat of the
   request's own text is the surest guess) and continues it by the pool; where nothing repeats,
   it follows the pool from the sequence's last n-1 tokens, and the refined guesses.
The pool and guesses are the request's own (never shared across requests or tenants) and are
dropped with it. Drafts are deterministic guesses (q one-hot), so the usual acceptance rules keep
the output exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config import SpeculativeConfig
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import Draft
from decode.spec.ngram import NgramProposer

POOL_N = 3          # n of the pool's n-grams: 2 tokens of context -> the target's next token
POOL_LIMIT = 4096   # entries per request (oldest dropped first)


@dataclass
class JacobiState:
    pool: dict[tuple[int, ...], int] = field(default_factory=dict)
    guess: list[int] = field(default_factory=list)   # guesses for the positions after `guess_at`
    guess_at: int = -1                               # the sequence length the guesses continue


class JacobiProposer:
    method = "jacobi"

    def __init__(self, config: SpeculativeConfig):
        self.lookup = NgramProposer(config.ngram_min, config.ngram_max)
        self.states: dict[Sequence, JacobiState] = {}

    def propose(self, seqs: list[Sequence], ks: list[int], stop_rules: list) -> list[Draft]:
        return [Draft(tuple(self.draft(s, k))) for s, k in zip(seqs, ks)]

    def draft(self, seq: Sequence, k: int) -> list[int]:
        """Prompt lookup first (a repeat of the request's own text is the surest guess), continued
        by the pool; where nothing repeats, the pool and the refined guesses."""
        tokens = list(seq.token_ids)
        out = self.lookup.propose(tokens, k)
        state = self.states.get(seq)
        if state is None:
            return out
        guess = state.guess if state.guess_at == len(tokens) and not out else []
        while len(out) < k:
            nxt = state.pool.get(tuple((tokens + out)[-(POOL_N - 1):]))
            if nxt is None and len(out) < len(guess):
                nxt = guess[len(out)]
            if nxt is None:
                break
            out.append(nxt)
        return out

    def observe(self, seq: Sequence, context: list[int], draft: tuple[int, ...], best: list[int], kept: int) -> None:
        """After a verification: `context` the tokens before it (the pending one last), `best`
        the target's argmax of each of its len(draft) + 1 rows, `kept` the tokens it appended."""
        state = self.states.setdefault(seq, JacobiState())
        seen = list(context[-(POOL_N - 1):])
        for i, prediction in enumerate(best):
            if len(seen) >= POOL_N - 1:
                state.pool[tuple(seen[-(POOL_N - 1):])] = prediction
            if i < len(draft):
                seen.append(draft[i])
        while len(state.pool) > POOL_LIMIT:
            state.pool.pop(next(iter(state.pool)))
        state.guess = best[kept:]           # row kept-1 gave the last kept token; rows after: the iterate
        state.guess_at = len(context) + kept

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq, None)
