"""The latency model the planner's rule and `splitserve plan` share: predicted TTFT and ITL of a
P:D split at a request rate, from a worker's step costs (`DeviceProfile`).

Prefill pool: requests spread evenly over P workers, each an M/D/1 queue whose service is one
prompt's prefill: TTFT = wait + service, wait = rho * S / (2 (1 - rho)).
Decode pool: a worker's batch b is its arrival rate times how long a sequence stays (Little's law:
b = rate/D * output_tokens * step(b)), solved by fixed-point iteration; ITL = step(b) plus the
KV transfer spread over the output. A pool at or past saturation predicts infinity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.planner.costs import DeviceProfile

INFEASIBLE = math.inf
STABLE_UTILIZATION = 0.7     # where no pool size meets an SLO: size for a queue that stays short


@dataclass(frozen=True)
class Load:
    rate: float                  # requests per second
    input_tokens: float          # mean prompt tokens computed (cached ones excluded)
    output_tokens: float


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int
    ttft_s: float
    itl_s: float
    fits_budget: bool            # both SLOs met within the worker budget

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


def prefill_ttft(costs: DeviceProfile, load: Load, prefill_workers: int, rate_scale: float = 1.0) -> float:
    service = costs.prefill_time(load.input_tokens) * rate_scale
    rho = load.rate / max(prefill_workers, 1) * service
    if rho >= 1.0:
        return INFEASIBLE
    return service + rho * service / (2 * (1 - rho))


def decode_batch(costs: DeviceProfile, load: Load, decode_workers: int, step_scale: float = 1.0) -> float:
    """The steady batch per decode worker (INFEASIBLE past the batch limit or saturation)."""
    context = load.input_tokens + load.output_tokens / 2
    per_worker = load.rate / max(decode_workers, 1) * load.output_tokens
    batch = 1.0
    for _ in range(60):
        nxt = per_worker * costs.decode_step(batch, context) * step_scale
        if nxt > costs.max_num_seqs:
            return INFEASIBLE
        if abs(nxt - batch) < 1e-3:
            return nxt
        batch = nxt
    return batch if batch <= costs.max_num_seqs else INFEASIBLE


def decode_itl(costs: DeviceProfile, load: Load, decode_workers: int, step_scale: float = 1.0) -> float:
    batch = decode_batch(costs, load, decode_workers, step_scale)
    if batch == INFEASIBLE:
        return INFEASIBLE
    step = costs.decode_step(batch, load.input_tokens + load.output_tokens / 2) * step_scale
    return step + costs.transfer_time(load.input_tokens) / max(load.output_tokens, 1.0)


def _smallest(predict, target: float, limit: int) -> int:
    """The fewest workers (1..limit) whose prediction meets `target` (limit + 1: none does)."""
    lo, hi = 1, limit + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if predict(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def choose_split(costs: DeviceProfile, load: Load, ttft_slo: float, itl_slo: float, max_workers: int,
                 margin: float = 0.8, prefill_scale: float = 1.0, decode_scale: float = 1.0) -> Split:
    """The fewest workers of each role predicted to meet `margin` times each SLO (where none can, the
    fewest that keep its queue stable); past the budget, the budget shared in proportion to what
    each role needs (at least one each)."""
    p = _smallest(lambda n: prefill_ttft(costs, load, n, prefill_scale), margin * ttft_slo, max_workers)
    if p > max_workers:     # no pool meets it (one prompt's prefill alone is too long): a stable queue
        service = costs.prefill_time(load.input_tokens) * prefill_scale
        p = _smallest(lambda n: load.rate * service / n, STABLE_UTILIZATION, max_workers)
    d = _smallest(lambda n: decode_itl(costs, load, n, decode_scale), margin * itl_slo, max_workers)
    if d > max_workers:     # no pool meets it (a step alone is too long): the fewest with a stable batch
        d = _smallest(lambda n: decode_itl(costs, load, n, decode_scale), INFEASIBLE / 2, max_workers)
    fits = p + d <= max_workers
    if not fits:
        p = min(max(1, round(max_workers * p / (p + d))), max_workers - 1)
        d = max_workers - p
    return Split(p, d, prefill_ttft(costs, load, p, prefill_scale), decode_itl(costs, load, d, decode_scale), fits)
