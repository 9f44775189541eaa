"""Speculation that cannot collapse: the step's lookahead cap, chosen from measured throughput at
the current batch size.

Per-request dynamic lookahead (lookahead.py) prices a draft token against a target step, but the
price of verifying it grows with the batch: at batch 1 a CPU decode step reads the weights once
for one row and extra rows are nearly free; at batch 32 the step is compute-bound and every
verified row costs about as much as a decoded one. The trackers show what a fixed cost model does
there (vLLM's dynamic speculation collapsing throughput past a batch-size threshold). So the step
itself is measured: for each batch-size bucket, a few caps on the lookahead of `auto` requests
(0 is plain decoding) are tried, their tokens per second are kept as decayed ratios over pure
decode steps, and the best one is used, with a small share of steps exploring its neighbours so
the choice follows the workload (acceptance changes with the text) and the machine. Where speculation
does not pay, cap 0 wins and the batch decodes plainly, losing at most the exploration share.

Requests with a fixed k (the server's `--num-speculative-tokens K`, or the request's own) are left
as asked.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass


def batch_bucket(batch: int) -> int:
    """1, 2, 3-4, 5-8, 9-16, ...: index of the power of two at or above the batch size."""
    return max(0, (batch - 1).bit_length())


@dataclass
class Arm:
    """Decayed sums of a cap's tokens and seconds: their ratio is its throughput. (A mean of
    per-step rates would overrate it: a step that accepts all its drafts is also a short one.)"""
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class StepLookahead:
    """The lookahead cap of each step's `auto` requests, from measured tokens per second."""

    TRIES = 4          # steps each cap gets at a bucket before the best is exploited
    DECAY = 0.95       # weight of the old sums per new step (about the last 20 steps count)

    def __init__(self, k_max: int, explore: float = 0.05, seed: int = 0):
        self.caps = sorted({c for c in (0, 1, 2, 4, k_max) if c <= k_max})
        self.explore = explore
        self.arms: dict[tuple[int, int], Arm] = {}
        self.rng = random.Random(seed)
        self._open: tuple[int, int, float, int] | None = None   # bucket, cap, start, decodes

    def cap(self, batch: int, measured: bool) -> int:
        """The cap for a step of `batch` decodes; `measured`: a pure decode step, timed until
        `observe` (a step with prompt chunks is neither timed nor used to explore)."""
        bucket = batch_bucket(batch)
        arms = [self.arms.setdefault((bucket, c), Arm()) for c in self.caps]
        untried = [c for c, a in zip(self.caps, arms) if a.samples < self.TRIES]
        best = max(range(len(self.caps)), key=lambda i: (arms[i].samples > 0, arms[i].rate))
        if measured and untried:
            cap = untried[-1]
        elif measured and self.rng.random() < self.explore:
            # A neighbour of the best: a cap far from it (8 where 0 is best) can cost a step or
            # two of throughput, while the neighbours are what the choice can drift to.
            cap = self.caps[self.rng.choice([i for i in (best - 1, best + 1) if 0 <= i < len(self.caps)])]
        else:
            cap = self.caps[best]
        self._open = (bucket, cap, time.perf_counter(), batch) if measured else None
        return cap

    def observe(self, extra_tokens: int) -> None:
        """The step is done: its decodes each emitted one token plus `extra_tokens` accepted drafts."""
        if self._open is None:
            return
        bucket, cap, start, decodes = self._open
        self._open = None
        seconds = time.perf_counter() - start
        if seconds <= 0:
            return
        arm = self.arms[(bucket, cap)]
        arm.tokens = self.DECAY * arm.tokens + decodes + extra_tokens
        arm.seconds = self.DECAY * arm.seconds + seconds
        arm.samples += 1

    def table(self) -> dict[int, dict[int, float]]:
        """Measured tokens/s by batch bucket and cap (for benches and logs)."""
        out: dict[int, dict[int, float]] = {}
        for (bucket, cap), arm in sorted(self.arms.items()):
            if arm.samples:
                out.setdefault(1 << bucket, {})[cap] = round(arm.rate, 1)
        return out
