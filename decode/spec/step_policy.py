"""Speculation that cannot collapse: the step's lookahead cap, chosen from measured throughput at
the current batch size.

Per-request dynamic lookahead (lookahead.py) prices a draft token against a target step, but the
price of verifying it grows with the batch: at batch 1 a CPU decode step reads the weights once
for one row and extra rows are nearly free; at batch 32 the step is compute-bound and every
verified row costs about as much as a decoded one. The trackers show what a fixed cost model does
there (vLLM's dynamic speculation collapsing throughput past a batch-size threshold). So the step
itself is measured: for each batch-size bucket, a few caps on the lookahead of `auto` requests
(0 is plain decoding) are tried, their tokens per second are kept as decayed means over pure
decode steps, and the best one is used, with a small share of steps exploring the others so the
choice follows the workload (acceptance changes with the text) and the machine. Where speculation
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
    rate: float = 0.0     # decayed mean tokens per second of its steps
    samples: int = 0


class StepLookahead:
    """The lookahead cap of each step's `auto` requests, from measured tokens per second."""

    TRIES = 3          # steps each cap gets at a bucket before the best is exploited
    DECAY = 0.85       # weight of the old mean per new step

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
        if measured and untried:
            cap = untried[-1]
        elif measured and self.rng.random() < self.explore:
            cap = self.rng.choice(self.caps)
        else:
            cap = max(zip(self.caps, arms), key=lambda ca: (ca[1].samples > 0, ca[1].rate))[0]
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
        rate = (decodes + extra_tokens) / seconds
        arm.rate = rate if arm.samples == 0 else self.DECAY * arm.rate + (1 - self.DECAY) * rate
        arm.samples += 1

    def table(self) -> dict[int, dict[int, float]]:
        """Measured tokens/s by batch bucket and cap (for benches and logs)."""
        out: dict[int, dict[int, float]] = {}
        for (bucket, cap), arm in sorted(self.arms.items()):
            if arm.samples:
                out.setdefault(1 << bucket, {})[cap] = round(arm.rate, 1)
        return out
