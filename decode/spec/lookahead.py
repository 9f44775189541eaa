"""Dynamic lookahead: how many tokens to propose next, per request, from what was accepted.

In the spirit of DISCO (dynamic speculation lookahead): a fixed k wastes verification slots when
the proposer is off track and leaves speed behind when it is on a run. Two signals adapt k:
 - per step, model proposers stop drafting once their own confidence (top probability) drops
   below a threshold (the proposer applies it; see `draft_confidence`);
 - per request, k grows by one after a fully accepted draft and falls to one past the accepted
   length after a rejection, within [1, k_max].
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Lookahead:
    k: int
    k_max: int
    dynamic: bool

    def after_verify(self, proposed: int, accepted: int) -> None:
        if not self.dynamic or proposed == 0:
            return
        if accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        else:
            self.k = max(1, min(self.k, accepted + 1))
