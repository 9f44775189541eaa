"""Dynamic lookahead: how many tokens to propose, per request and per step, from what pays.

In the spirit of DISCO (dynamic speculation lookahead), drafting continues only while the next
token is expected to be worth its cost. A draft token at depth i is used only if it and every
token before it is accepted, so its expected value is the product of the acceptance
probabilities up to i, in units of one target step; its cost is one draft step, the ratio
tau = t_draft / t_target measured while serving. So:
 - per request, k = the largest i with alpha^i >= tau, where alpha is the request's recent
   per-token acceptance rate (a decayed count of accepted and rejected draft tokens);
 - per step, model proposers stop drafting once the running product of their own top-token
   probabilities, calibrated against the acceptance they have earned, falls below tau (`StopRule`).
A model-free proposer (n-gram) costs almost nothing to draft; its tau is the cost of one more
verified position relative to a step, small at low batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_DECAY = 0.9


@dataclass
class Lookahead:
    k: int                 # fixed k, or the current dynamic k
    k_max: int
    dynamic: bool
    accepted: float = 3.0  # decayed counts of accepted / rejected draft tokens (a prior of 0.75)
    rejected: float = 1.0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def next_k(self, tau: float) -> int:
        if not self.dynamic:
            return self.k
        alpha = self.alpha
        if alpha >= 0.999:
            return self.k_max
        self.k = max(1, min(self.k_max, round(math.log(max(tau, 1e-6)) / math.log(alpha))))
        return self.k

    def after_verify(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.accepted = _DECAY * self.accepted + accepted
        self.rejected = _DECAY * self.rejected + (1 if accepted < proposed else 0)


@dataclass(frozen=True)
class StopRule:
    """Per step: one more draft step (it costs tau target steps, whatever the batch) yields, for
    each sequence, one token used with the calibrated chance that it and every draft token before
    it are accepted; one target step yields one token per sequence. So drafting goes on while the
    mean chance over the batch is at least tau. `calibration` maps the proposer's top probability
    onto the acceptance it has actually earned (a draft head is often under- or over-confident)."""
    tau: float
    calibration: float = 1.0

    def chance(self, confidences: list[float]) -> float:
        out = 1.0
        for c in confidences:
            out *= min(1.0, c * self.calibration)
        return out


def keep_drafting(rules: list, confidences: list[list[float]], open_: list[bool]) -> bool:
    """Whether a batch draft step pays: a fixed-k sequence still short of its k wants it; dynamic
    ones want it while their mean chance (closed sequences count 0) reaches tau."""
    if any(o and r is None for r, o in zip(rules, open_)):
        return True
    dynamic = [(r, c, o) for r, c, o in zip(rules, confidences, open_) if r is not None]
    if not dynamic:
        return False
    mean = sum(r.chance(c) for r, c, o in dynamic if o) / len(dynamic)
    return mean >= dynamic[0][0].tau


class Calibration:
    """Decayed ratio of accepted draft tokens to the confidence the proposer put in them."""

    def __init__(self):
        self.accepted = 1.0
        self.predicted = 1.0

    @property
    def factor(self) -> float:
        return self.accepted / self.predicted

    def observe(self, confidences: tuple[float, ...], accepted: int) -> None:
        judged = confidences[:accepted + 1]   # tokens past the first rejection were never judged
        self.accepted = 0.98 * self.accepted + accepted
        self.predicted = 0.98 * self.predicted + sum(judged)


def draw_draft_token(row, seq, need_confidence: bool):
    """One draft token from a proposer's logits row: argmax for greedy requests, a sample from the
    request's warped distribution otherwise. Returns (token, the distribution sampled or None,
    the top probability, or 1.0 when not needed)."""
    import torch  # noqa: PLC0415

    from cluster.engine.sampler import sample_row, warp_probs  # noqa: PLC0415
    sp = seq.sampling
    if sp.greedy:
        top = float(torch.softmax(row, -1).max()) if need_confidence else 1.0
        return int(torch.argmax(row)), None, top
    p = warp_probs(row, sp)
    return sample_row(p, seq.generator), p, float(p.max())
