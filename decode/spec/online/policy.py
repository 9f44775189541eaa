"""When a tenant's candidate head goes live, and when a live head is rolled back.

 - Promotion: a candidate goes live only if its score on held-out recent traffic (the newest
   samples, never trained on) beats the live head's on the same samples by `margin`, and by twice
   the standard error of the paired difference (a small held-out set must not decide by chance).
 - Probation: a promoted head serves one evaluation window (`window` verifications, all decode
   workers together); then the traffic served during the window is replayed through it and through
   the head before it. If the new head accepts less on that traffic, it is rolled back. Comparing
   both heads on the same fresh traffic keeps a workload shift (which moves both) from reading as a
   worse head, or hiding one.
Plain logic over numbers: the service (service.py) measures, this decides.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from decode.spec.online.messages import BASE_VERSION, AcceptanceCount


class Phase(enum.Enum):
    SERVING = "serving"        # the live head has been confirmed (or is the base)
    PROBATION = "probation"    # promoted; its first window is being measured


class Verdict(enum.Enum):
    WAIT = "wait"              # the window is not full yet
    KEEP = "keep"              # the window is full and the new head held up
    ROLLBACK = "rollback"


@dataclass
class TenantPolicy:
    window: int
    margin: float = 0.02
    live: int = BASE_VERSION
    previous: int | None = None          # the head before the live one, while on probation
    phase: Phase = Phase.SERVING
    window_steps: int = 0                # verifications by the live head since its promotion

    def promotes(self, candidate_score: float, live_score: float, noise: float = 0.0) -> bool:
        """`noise`: the standard error of the scores' paired difference; the gain must be twice it."""
        gain = candidate_score - live_score
        return self.phase is Phase.SERVING and candidate_score > live_score * (1 + self.margin) and gain > 2 * noise

    def promoted(self, version: int) -> None:
        self.previous, self.live = self.live, version
        self.phase, self.window_steps = Phase.PROBATION, 0

    def observe(self, counts: list[AcceptanceCount]) -> None:
        for c in counts:
            if c.version == self.live and self.phase is Phase.PROBATION:
                self.window_steps += c.steps

    def window_full(self) -> bool:
        return self.phase is Phase.PROBATION and self.window_steps >= self.window

    def judge(self, live_score: float, previous_score: float) -> Verdict:
        """After a full window: both heads' scores on the window's traffic."""
        if not self.window_full():
            return Verdict.WAIT
        if live_score < previous_score:
            self.live, self.previous, self.phase = self.previous, None, Phase.SERVING
            return Verdict.ROLLBACK
        self.previous, self.phase = None, Phase.SERVING
        return Verdict.KEEP
