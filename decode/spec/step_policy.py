"""Speculation that cannot collapse: the step's lookahead cap, chosen from measured throughput at
the current batch size.

Per-request dynamic lookahead (lookahead.py) prices a draft token against a target step, but the
price of verifying it grows with the batch: at batch 1 a CPU decode step reads the weights once
for one row and extra rows are nearly free; at batch 32 the step is compute-bound and every
verified row costs about as much as a decoded one. The trackers show what a fixed cost model does
there (vLLM's dynamic speculation collapsing throughput past a batch-size threshold). So the step
itself is measured: for each batch-size bucket, a few caps on the lookahead of `auto` requests
(0 is plain decoding) are tried, their tokens per second are kept as decayed ratios over pure
decode steps, and the best one is used, with a small share of the time exploring its neighbours so
the choice follows the workload (acceptance changes with the text) and the machine. Where speculation
does not pay, cap 0 wins and the batch decodes plainly, losing at most the exploration share.

The first tries climb: caps are tried from 0 upwards while each beats every cap before it, so
at a batch where lookahead stops paying the larger caps are never tried (an exploring step only
ever tries a neighbour of the best). With a token-tree budget (`--spec-tree-budget`), a cap above
0 also comes as a second arm with the step's tree leaves on (decode/spec/tree.py), tried once the
cap is the best: whether a step's extra verified rows pay depends on the batch and the machine (on
a CPU a ninth row costs a second pass over the weights in the small-batch linear).

Greedy requests on the server's fixed k (`--num-speculative-tokens K`, the request naming none)
get a policy of their own, `StepLookahead(..., fixed=StepSetting(K, budget))`: two arms, the
server's setting (tried first: what was configured) and plain decoding, so at a batch where K
drafts cost more than they save the batch decodes plainly. Their output does not depend on it
(greedy verification keeps the target's tokens). Requests naming their own k, sampled requests
(their draws depend on k: reproducible with a seed), a step of one decode (its verified rows are
nearly free) and the deterministic mode (drafting follows the configuration, not timings) are left
as asked (decode/spec/speculator.py).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass


def batch_bucket(batch: int) -> int:
    """1, 2, 3-4, 5-8, 9-16, ...: index of the power of two at or above the batch size."""
    return max(0, (batch - 1).bit_length())


@dataclass(frozen=True)
class StepSetting:
    cap: int           # the lookahead cap of `auto` requests (0: plain decoding)
    leaves: int = 0    # token-tree leaves the step may add (0: chains)


@dataclass
class Arm:
    """Decayed sums of a cap's tokens and seconds: their ratio is its throughput. (A mean of
    per-step rates would overrate it: a step that accepts all its drafts is also a short one.)"""
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    steps: float = 0.0     # decayed like the sums: seconds / steps is its mean step time

    @property
    def step_seconds(self) -> float:
        return self.seconds / self.steps if self.steps > 0 else 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class StepLookahead:
    """The lookahead cap of each step's `auto` requests, from measured tokens per second."""

    TRIES = 4          # steps each cap gets at a bucket before the best is exploited
    DECAY = 0.95       # weight of the old sums per new step (about the last 20 steps count)

    def __init__(self, k_max: int, explore: float = 0.05, seed: int = 0, tree_leaves: int = 0,
                 fixed: StepSetting | None = None):
        self.caps = sorted({c for c in (0, 1, 2, 4, k_max) if c <= k_max})
        self.tree_leaves = tree_leaves
        self.fixed = fixed     # a fixed k's policy: that setting (tried first) or plain decoding
        self.explore = explore
        self.arms: dict[tuple[int, StepSetting], Arm] = {}
        self.rng = random.Random(seed)
        self._open: tuple[int, StepSetting, float, int] | None = None   # bucket, setting, start, decodes

    @property
    def settings(self) -> list[StepSetting]:
        """Every arm, in order of how much a step verifies."""
        if self.fixed is not None:
            return [StepSetting(0), self.fixed]
        return [s for c in self.caps for s in ((StepSetting(c), StepSetting(c, self.tree_leaves))
                                               if c and self.tree_leaves else (StepSetting(c),))]

    def cap(self, batch: int, measured: bool) -> int:
        return self.choose(batch, measured).cap

    def choose(self, batch: int, measured: bool) -> StepSetting:
        """The setting for a step of `batch` decodes; `measured`: a pure decode step, timed until
        `observe` (a step with prompt chunks is neither timed nor used to explore)."""
        bucket = batch_bucket(batch)
        best = self._best(bucket)
        choice = best
        if measured:
            trial = self._trial(bucket, best)
            if trial is not None:
                choice = trial
            elif self.rng.random() < self.explore:
                # A neighbour of the best: a setting far from it (8 where 0 is best) can cost a
                # step or two of throughput, while the neighbours are what the choice can drift to.
                # Taken in proportion to how much shorter the best's steps are: exploring takes
                # `explore` of the time, not of the steps (a fixed k = 4 step at batch 8 can cost
                # several plain ones).
                neighbour = self.rng.choice(self._neighbours(best))
                if self.rng.random() < self._time_share(bucket, best, neighbour):
                    choice = neighbour
        self._open = (bucket, choice, time.perf_counter(), batch) if measured else None
        return choice

    def _time_share(self, bucket: int, best: StepSetting, other: StepSetting) -> float:
        ours, theirs = self._arm(bucket, best).step_seconds, self._arm(bucket, other).step_seconds
        return 1.0 if ours <= 0 or theirs <= 0 else min(1.0, ours / theirs)

    def _arm(self, bucket: int, setting: StepSetting) -> Arm:
        return self.arms.setdefault((bucket, setting), Arm())

    def _best(self, bucket: int) -> StepSetting:
        """The measured arm of the highest rate; before any is measured, plain decoding (a fixed
        k's policy: its setting, as configured)."""
        measured = [s for s in self.settings if self._arm(bucket, s).samples]
        if not measured:
            return self.fixed or StepSetting(0)
        return max(measured, key=lambda s: (self._arm(bucket, s).rate, -s.cap))

    def _trial(self, bucket: int, best: StepSetting) -> StepSetting | None:
        """The setting still owed its first tries: caps climb from 0 while each beats every cap
        before it (a larger cap is tried only while lookahead keeps paying, so a large batch
        never tries cap 8), then the best cap's tree arm. A fixed k's policy tries its setting,
        then plain decoding."""
        if self.fixed is not None:
            return next((s for s in (self.fixed, StepSetting(0)) if self._arm(bucket, s).samples < self.TRIES), None)
        climbed = 0.0
        for cap in self.caps:
            arm = self._arm(bucket, StepSetting(cap))
            if arm.samples < self.TRIES:
                return StepSetting(cap)
            if arm.rate < climbed:
                break    # this cap did worse than a smaller one: the larger ones wait for exploring steps
            climbed = arm.rate
        if best.cap and self.tree_leaves:
            tree = StepSetting(best.cap, self.tree_leaves)
            if self._arm(bucket, tree).samples < self.TRIES:
                return tree
        return None

    def _neighbours(self, best: StepSetting) -> list[StepSetting]:
        """The caps beside the best one (chains), and the best cap with its tree leaves on or off."""
        if self.fixed is not None:
            return [s for s in self.settings if s != best]
        i = self.caps.index(best.cap)
        out = [StepSetting(self.caps[j]) for j in (i - 1, i + 1) if 0 <= j < len(self.caps)]
        if best.cap and self.tree_leaves:
            out.append(StepSetting(best.cap, 0 if best.leaves else self.tree_leaves))
        return out

    def observe(self, extra_tokens: int) -> None:
        """The step is done: its decodes each emitted one token plus `extra_tokens` accepted drafts."""
        if self._open is None:
            return
        bucket, setting, start, decodes = self._open
        self._open = None
        seconds = time.perf_counter() - start
        if seconds <= 0:
            return
        arm = self.arms[(bucket, setting)]
        arm.tokens = self.DECAY * arm.tokens + decodes + extra_tokens
        arm.seconds = self.DECAY * arm.seconds + seconds
        arm.steps = self.DECAY * arm.steps + 1
        arm.samples += 1

    def table(self) -> dict[int, dict[str, float]]:
        """Measured tokens/s by batch size bucket and setting ("4", or "4+t" with tree leaves)."""
        out: dict[int, dict[str, float]] = {}
        for (bucket, s), arm in sorted(self.arms.items(), key=lambda kv: (kv[0][0], kv[0][1].cap, kv[0][1].leaves)):
            if arm.samples:
                out.setdefault(1 << bucket, {})[f"{s.cap}+t" if s.leaves else str(s.cap)] = round(arm.rate, 1)
        return out
