"""The engine's side of speculative decoding: what a speculator must provide, and what a draft is.

The engine owns the mechanics: it asks the speculator how many tokens each running decode should
propose (`lookahead`), reserves KV blocks for them (never preempting anyone for a guess), asks
for the drafts (`propose`), verifies k+1 positions of every drafted sequence in the same forward
pass as the rest of the batch, and hands each sequence's k+1 rows of logits back (`verify`),
which returns the tokens to append: the accepted prefix plus one token of the target's own.
Rejected positions roll back in the scheduler (their KV slots are overwritten later and blocks
reserved past the kept tokens go back to the pool).

The policy lives with the decode workers (`decode/spec/`): proposers, acceptance rules, dynamic
lookahead. Prefill workers run no speculator; with an EAGLE head configured they still compute
the head's KV (`cluster/model/eagle.py`) so a handed-off request can speculate at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.engine.sequence import Sequence


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None   # [k, V] what each token was drawn from; None: a deterministic guess
    confidences: tuple[float, ...] = ()  # the proposer's top probability per token (dynamic lookahead)

    def __len__(self) -> int:
        return len(self.tokens)


class Speculator(Protocol):
    def lookahead(self, seq: Sequence) -> int:
        """Tokens to propose for `seq` this step (0: a plain decode step)."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Drafts of at most ks[i] tokens, each continuing seqs[i].token_ids."""

    def verify(self, seq: Sequence, logits: torch.Tensor, draft: Draft) -> list[int]:
        """logits [len(draft)+1, V] at the last token and after each draft token: the tokens to append."""

    def release(self, seq: Sequence) -> None:
        """Forget a request's proposer state (it finished, was aborted or preempted)."""

    def stats(self) -> dict:
        """Counters by method: drafted, accepted, verify steps."""
