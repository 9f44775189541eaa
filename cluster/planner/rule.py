"""The SLA planner's decision rule, as plain functions: a metrics snapshot and the rule's state in,
actions and the next state out. No clock, no I/O: the live loop and the simulator call the same one.

Each interval:
1. Forecast the arrival rate when a worker added now would serve (Holt's linear smoothing: an EWMA
   level plus the trend over the worker's start and one interval), never below what was just seen, plus the queued backlog to drain within one interval: a queue
   that grows while the mean TTFT still looks fine (Dynamo #10528) raises the load the rule sizes for.
2. Recalibrate the profile's costs by the workers' measured ones (prefill tokens/s, decode step).
3. Size each pool (capacity.choose_split): up to `margin` x SLO when growing, at once; down only to
   what meets `down_margin` x SLO (a band between the two: no flapping), and only after
   `down_intervals` intervals in a row wanted fewer. A queue time past the TTFT SLO adds a prefill
   worker whatever the model says, and blocks shrinking the prefill pool.
4. Stay within `max_workers` (past it the budget is shared in proportion to need); move workers
   between roles by switching (no weight reload) before adding or removing.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.planner.capacity import Load, Split, choose_split
from cluster.planner.costs import DeviceProfile
from cluster.planner.snapshot import (
    DECODE,
    PREFILL,
    Action,
    ActionKind,
    MetricsSnapshot,
    WorkerSnapshot,
)


@dataclass(frozen=True)
class RuleConfig:
    ttft_slo_s: float
    itl_slo_s: float
    max_workers: int
    margin: float = 0.8            # grow to meet this share of each SLO
    down_margin: float = 0.6       # shrink only to what still meets this share
    down_intervals: int = 3        # intervals in a row wanting fewer before shrinking
    alpha: float = 0.7            # EWMA weight of the newest rate
    beta: float = 0.5             # weight of the newest trend
    length_alpha: float = 0.3     # EWMA weight of the newest interval's mean prompt and completion lengths


@dataclass(frozen=True)
class PlannerState:
    level: float | None = None     # smoothed arrival rate
    trend: float = 0.0
    input_tokens: float = 256.0    # last seen means (an idle interval has none)
    output_tokens: float = 128.0
    lengths_seen: bool = False
    down_streak: tuple[int, int] = (0, 0)    # (prefill, decode)


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    state: PlannerState
    forecast_rate: float
    split: Split


def forecast(state: PlannerState, observed: float, cfg: RuleConfig, lead: float = 1.0) -> tuple[float, PlannerState]:
    """The rate `lead` intervals ahead (Holt's level + lead x trend), at least the rate just observed."""
    if state.level is None:
        level, trend = observed, 0.0
    else:
        level = cfg.alpha * observed + (1 - cfg.alpha) * (state.level + state.trend)
        trend = cfg.beta * (level - state.level) + (1 - cfg.beta) * state.trend
    return max(observed, level + lead * trend, 0.0), replace(state, level=level, trend=trend)


def calibration(snap: MetricsSnapshot, costs: DeviceProfile, load: Load) -> tuple[float, float]:
    """(prefill, decode) time scales: measured cost over the profile's, 1 where unmeasured."""
    pre = [costs.prefill_tokens_per_s(load.input_tokens) / w.prefill_tokens_per_s
           for w in snap.workers if w.role == PREFILL and w.prefill_tokens_per_s > 0]
    dec = [w.decode_step_s / costs.decode_step(w.running, load.input_tokens + load.output_tokens / 2)
           for w in snap.workers if w.role == DECODE and w.decode_step_s > 0 and w.running > 0]
    clamp = lambda xs: min(max(sum(xs) / len(xs), 0.25), 4.0) if xs else 1.0
    return clamp(pre), clamp(dec)


def decide(snap: MetricsSnapshot, state: PlannerState, cfg: RuleConfig, costs: DeviceProfile) -> Decision:
    if snap.arrival_rate > 0 and snap.mean_input_tokens > 0:     # lengths smoothed: a few long prompts swing them
        w = cfg.length_alpha if state.lengths_seen else 1.0
        state = replace(state, input_tokens=w * snap.mean_input_tokens + (1 - w) * state.input_tokens,
                        output_tokens=w * max(snap.mean_output_tokens, 1.0) + (1 - w) * state.output_tokens,
                        lengths_seen=True)
    # A worker added now serves after its start: size for the load then, not for the next interval's.
    lead = 1.0 + costs.worker_start_s / max(snap.interval_s, 1e-9)
    rate, state = forecast(state, snap.arrival_rate, cfg, lead)
    backlog = snap.queued_requests / max(snap.interval_s, 1e-9)
    load = Load(rate + backlog, state.input_tokens, state.output_tokens)
    pre_scale, dec_scale = calibration(snap, costs, load)
    up = choose_split(costs, load, cfg.ttft_slo_s, cfg.itl_slo_s, cfg.max_workers, cfg.margin, pre_scale, dec_scale)
    down = choose_split(costs, load, cfg.ttft_slo_s, cfg.itl_slo_s, cfg.max_workers, cfg.down_margin, pre_scale,
                        dec_scale)
    current = (snap.count(PREFILL), snap.count(DECODE))
    queue_hot = snap.queue_time_s > cfg.ttft_slo_s * cfg.down_margin
    want, streak = [], []
    for i, (cur, grow, shrink) in enumerate(zip(current, (up.prefill, up.decode), (down.prefill, down.decode))):
        run = state.down_streak[i] + 1 if shrink < cur and not (i == 0 and queue_hot) else 0
        want.append(grow if grow > cur else shrink if run >= cfg.down_intervals else cur)
        streak.append(0 if want[i] != cur else run)
    if snap.queue_time_s > cfg.ttft_slo_s and want[0] <= current[0]:
        want[0] = current[0] + 1      # the queue says the prefill pool is short, whatever the model says
    want = _within_budget(want, cfg.max_workers)
    actions = plan_actions(snap, current, tuple(want))
    return Decision(actions, replace(state, down_streak=tuple(streak)), rate, up)


def _within_budget(want: list[int], budget: int) -> list[int]:
    want = [max(1, w) for w in want]
    if sum(want) <= budget:
        return want
    p = min(max(1, round(budget * want[0] / sum(want))), budget - 1)
    return [p, budget - p]


def _by_load(snap: MetricsSnapshot, role: str) -> list[WorkerSnapshot]:
    return sorted((w for w in snap.workers if w.role == role), key=lambda w: (w.running + w.queued, w.name))


def plan_actions(snap: MetricsSnapshot, current: tuple[int, int], want: tuple[int, int]) -> tuple[Action, ...]:
    """Switch the least loaded workers of a shrinking role to a growing one, then add or remove."""
    delta = {PREFILL: want[0] - current[0], DECODE: want[1] - current[1]}
    actions: list[Action] = []
    for src, dst in ((DECODE, PREFILL), (PREFILL, DECODE)):
        moves = min(max(delta[dst], 0), max(-delta[src], 0))
        for w in _by_load(snap, src)[:moves]:
            actions.append(Action(ActionKind.SWITCH, src, w.name, dst))
        delta[dst] -= moves
        delta[src] += moves
    for role in (PREFILL, DECODE):
        actions += [Action(ActionKind.ADD, role)] * max(delta[role], 0)
        removable = _by_load(snap, role)[:max(-delta[role], 0)]
        actions += [Action(ActionKind.REMOVE, role, w.name) for w in removable]
    return tuple(actions)


class SlaRule:
    """The rule with its state kept between calls: what `run_planner` and the simulator call."""

    def __init__(self, cfg: RuleConfig, costs: DeviceProfile):
        self.cfg = cfg
        self.costs = costs
        self.state = PlannerState()
        self.last: Decision | None = None

    def __call__(self, snap: MetricsSnapshot) -> tuple[Action, ...]:
        self.last = decide(snap, self.state, self.cfg, self.costs)
        self.state = self.last.state
        return self.last.actions


class FixedRule:
    """No planner: the split stays as started (the baseline the planner is measured against)."""

    def __call__(self, snap: MetricsSnapshot) -> tuple[Action, ...]:
        return ()


def split_counts(actions: tuple[Action, ...], current: tuple[int, int]) -> tuple[int, int]:
    """The (prefill, decode) counts once `actions` are done."""
    p, d = current
    for a in actions:
        sign = {ActionKind.ADD: 1, ActionKind.REMOVE: -1}.get(a.kind, 0)
        if a.kind is ActionKind.SWITCH:
            p, d = (p + 1, d - 1) if a.to_role == PREFILL else (p - 1, d + 1)
        elif a.role == PREFILL:
            p += sign
        else:
            d += sign
    return p, d


