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

import torch

from cluster.engine.sampler import sample_row, warp_probs
from cluster.engine.speculation import Draft
from decode.spec.tree import Alternative

_DECAY = 0.9


@dataclass
class Lookahead:
    k: int                 # fixed k, or the current dynamic k
    k_max: int
    dynamic: bool
    accepted: float = 3.0  # decayed counts of accepted / rejected draft tokens (a prior of 0.75)
    rejected: float = 1.0
    server_k: bool = False  # a greedy request on the server's fixed k: that k or none, per step (step_policy.py)

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


class DraftBatch:
    """What a model proposer's batched drafting loop tracks: tokens, the distributions sampled
    (for the p/q rule), confidences, and which sequences stay open."""

    def __init__(self, seqs, ks: list[int], stop_rules: list, alternatives: list[bool] | None = None):
        self.seqs, self.ks, self.stop_rules = seqs, ks, stop_rules
        # Greedy rows that also keep their runner-up token per depth (token trees, decode/spec/tree.py).
        self.wants_alternatives = alternatives or [False] * len(seqs)
        self.alternatives: list[list[Alternative]] = [[] for _ in seqs]
        self.tokens: list[list[int]] = [[] for _ in seqs]
        self.probs: list[list] = [[] for _ in seqs]
        self.confidence: list[list[float]] = [[] for _ in seqs]

    def step(self, active: list[int], logits) -> list[int]:
        """Draw one token for each active sequence (row j of `logits` is sequence active[j]);
        returns the positions j of those that stay open, or [] once another step does not pay."""
        open_rows = []
        for j, i in enumerate(active):
            sp = self.seqs[i].sampling
            if sp.greedy and self.wants_alternatives[i]:
                probs, ids = torch.softmax(logits[j], -1).topk(2)
                (top, second), (tok, runner_up) = probs.tolist(), ids.tolist()
                self.alternatives[i].append(Alternative(runner_up, second))
            elif sp.greedy:
                top = float(torch.softmax(logits[j], -1).max()) if self.stop_rules[i] is not None else 1.0
                tok = int(torch.argmax(logits[j]))
            else:
                p = warp_probs(logits[j], sp)
                tok, top = sample_row(p, self.seqs[i].generator), float(p.max())
                self.probs[i].append(p)
            self.tokens[i].append(tok)
            self.confidence[i].append(top)
            if len(self.tokens[i]) < self.ks[i]:
                open_rows.append(j)
        # A draft step costs the same for one sequence or the whole batch: it runs while the
        # batch's expected gain pays for it, and every open sequence rides along.
        return open_rows if open_rows and self._pays({active[j] for j in open_rows}) else []

    def _pays(self, open_: set[int]) -> bool:
        """A fixed-k sequence short of its k wants another step; dynamic ones want it while their
        mean chance (closed sequences count 0) reaches tau."""
        if any(r is None for i, r in enumerate(self.stop_rules) if i in open_):
            return True
        dynamic = [i for i, r in enumerate(self.stop_rules) if r is not None]
        if not dynamic:
            return False
        rule = self.stop_rules[dynamic[0]]
        mean = sum(rule.chance(self.confidence[i]) for i in dynamic if i in open_) / len(dynamic)
        return mean >= rule.tau

    def drafts(self) -> list[Draft]:
        return [Draft(tuple(t), torch.stack(p) if p else None, tuple(c))
                for t, p, c in zip(self.tokens, self.probs, self.confidence)]
