"""The SLA planner on a running cluster (`serve --planner sla`): the same rule the simulator runs
(cluster/planner/rule.py), fed from the driver's own measurements and acting through the admin
operations (cluster/launch/admin.py), on a thread of its own so that a round's arithmetic never
holds the driver's event loop.

`LiveSnapshots` turns the driver's counters into one interval's `MetricsSnapshot`: the request
histograms' sums and counts since the last snapshot (TTFT, ITL, prompt and output lengths), the
workers' newest stats (queue, batch, KV use, measured prefill speed and queue time), and the
workers still loading. `AdminActuator` carries the actions out, each one to its end (a drain
finished) before the next; a switch where the workers cannot switch roles (no
`--switchable-roles`) becomes an addition and a removal.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from cluster.launch.admin import ClusterAdmin
from cluster.planner.costs import DEFAULT_PROFILE, DeviceProfile, load_profile
from cluster.planner.loop import run_planner
from cluster.planner.planner_config import PlannerConfig
from cluster.planner.rule import RuleConfig, SlaRule
from cluster.planner.snapshot import MetricsSnapshot, WorkerSnapshot
from cluster.worker_messages import WorkerStats

log = logging.getLogger(__name__)
PREFIX = "splitserve_"
# The series whose change over an interval the snapshot reads (request histograms: _sum and _count).
_SERIES = ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_prompt_tokens",
           "request_generation_tokens")


class LiveSnapshots:
    """One interval's snapshot per call, from `metrics` (cluster/metrics.py ClusterMetrics: the
    driver's request series and its workers' stats) and the admin's workers still loading."""

    def __init__(self, metrics, admin: ClusterAdmin, clock: Callable[[], float] = time.monotonic):
        self.metrics, self.admin, self.clock = metrics, admin, clock
        self.last_at = clock()
        self.last = self._totals()

    def _totals(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for family in self.metrics.request_samples():
            for s in family.samples:
                totals[s.name] = totals.get(s.name, 0.0) + s.value
        for s in self.metrics.worker_stats.values():
            for field in ("queue_seconds", "queue_count", "prompt_tokens_computed", "prompt_seconds"):
                totals[field] = totals.get(field, 0.0) + getattr(s, field)
        return totals

    def _delta(self, now: dict[str, float], name: str) -> float:
        return now.get(name, 0.0) - self.last.get(name, 0.0)

    def _mean(self, now: dict[str, float], series: str) -> float:
        count = self._delta(now, f"{PREFIX}{series}_count")
        return self._delta(now, f"{PREFIX}{series}_sum") / count if count > 0 else 0.0

    def __call__(self) -> MetricsSnapshot:
        now, at = self._totals(), self.clock()
        interval = max(at - self.last_at, 1e-6)
        stats = [s for s in self.metrics.worker_stats.values() if s.ready]
        queued = sum(s.waiting for s in stats)
        started = self._delta(now, f"{PREFIX}time_to_first_token_seconds_count")
        waited = self._delta(now, "queue_count")
        queue_time = self._delta(now, "queue_seconds") / waited if waited > 0 else 0.0
        snap = MetricsSnapshot(
            time_s=at, interval_s=interval, arrival_rate=(started + queued) / interval,
            mean_input_tokens=self._mean(now, "request_prompt_tokens"),
            mean_output_tokens=self._mean(now, "request_generation_tokens"),
            queue_time_s=max(queue_time, self._mean(now, "time_to_first_token_seconds")), queued_requests=queued,
            ttft_s=self._mean(now, "time_to_first_token_seconds"), itl_s=self._mean(now, "inter_token_latency_seconds"),
            kv_usage=max((_kv_usage(s) for s in stats), default=0.0),
            workers=tuple(_worker(s) for s in stats if s.name in self.admin.pool.records),
            pending=tuple(self.admin.starting.values()))
        self.last, self.last_at = now, at
        return snap


def _kv_usage(s: WorkerStats) -> float:
    return 1.0 - s.blocks_free / s.blocks_total if s.blocks_total else 0.0


def _worker(s: WorkerStats) -> WorkerSnapshot:
    role = "decode" if s.role == "colocated" else s.role
    tps = s.prompt_tokens_computed / s.prompt_seconds if s.prompt_seconds > 0 else 0.0
    return WorkerSnapshot(s.name, role, running=s.running, queued=s.waiting, kv_usage=_kv_usage(s),
                          prefill_tokens_per_s=tps if role == "prefill" else 0.0)


class AdminActuator:
    """The planner's actions on the admin, from the planner's thread onto the driver's loop."""

    def __init__(self, admin: ClusterAdmin, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.admin, self.loop, self.timeout_s = admin, loop, timeout_s

    def _run(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def add(self, role: str) -> None:
        self._run(self.admin.add(role))

    def remove(self, name: str) -> None:
        self._run(self.admin.remove(name))

    def switch(self, name: str, to: str) -> None:
        if self.admin.wiring.switchable:
            self._run(self.admin.switch(name, to))
            return
        self.add(to)          # weights reloaded: the new worker serves before the old one leaves
        self.remove(name)


class LivePlanner:
    """`run_planner` on its thread until `stop`; the rule kept for the metrics and the tests."""

    def __init__(self, config: PlannerConfig, costs: DeviceProfile, snapshots: LiveSnapshots,
                 actuator: AdminActuator):
        self.rule = SlaRule(RuleConfig(config.ttft_slo_s, config.itl_slo_s, config.max_workers), costs)
        self.snapshots, self.actuator, self.interval_s = snapshots, actuator, config.interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sla-planner", daemon=True)

    def start(self) -> LivePlanner:
        self._thread.start()
        log.info("planner: sla, deciding every %.0fs", self.interval_s)
        return self

    def _loop(self) -> None:
        if not self._stop.wait(self.interval_s):      # the first round reads a whole interval
            run_planner(self.snapshots, self.actuator, self.rule, self.interval_s, stop=self._stop)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():     # an action under way ends with the cluster (a daemon thread)
            self._thread.join(timeout=5.0)


def start_live_planner(config: PlannerConfig, admin: ClusterAdmin | None, metrics) -> LivePlanner | None:
    """`--planner sla` on this cluster (None when off); its actions wait at most the admin's drain
    timeout plus a worker's start."""
    if config.mode == "off" or admin is None:
        return None
    costs = load_profile(config.profile or DEFAULT_PROFILE)
    actuator = AdminActuator(admin, asyncio.get_running_loop(), admin.drain_timeout_s + 600.0)
    return LivePlanner(config, costs, LiveSnapshots(metrics, admin), actuator).start()
