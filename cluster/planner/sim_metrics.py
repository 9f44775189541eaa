"""The simulator's measurements: a planner interval's window (what `MetricsSnapshot` holds, as the
router measures it live) and the run's summary (TTFT and ITL percentiles, goodput)."""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.planner.sim_workers import SimRequest, SimWorker, WorkerState
from cluster.planner.snapshot import DECODE, MetricsSnapshot, WorkerSnapshot


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `values` (0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def request_itl(req: SimRequest) -> float:
    """A request's mean gap between tokens after the first."""
    if req.done_s is None or req.first_token_s is None or req.trace.output_tokens < 2:
        return 0.0
    return (req.done_s - req.first_token_s) / (req.trace.output_tokens - 1)


@dataclass
class Window:
    arrivals: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    ttfts: list = field(default_factory=list)
    itls: list = field(default_factory=list)

    def arrived(self, req: SimRequest) -> None:
        """Counted once routed: its prompt tokens are those its worker computes (cached ones are not)."""
        self.arrivals += 1
        self.input_tokens += req.compute_tokens
        self.output_tokens += req.trace.output_tokens

    def first_token(self, req: SimRequest) -> None:
        self.ttfts.append(req.first_token_s - req.arrival_s)

    def finished(self, req: SimRequest) -> None:
        self.itls.append(request_itl(req))

    def snapshot(self, now: float, interval_s: float, workers, pending: list[str]) -> MetricsSnapshot:
        serving = [w for w in workers if w.state is WorkerState.SERVING]
        queued = [r for w in serving for r in w.queue]
        oldest = max((now - r.arrival_s for r in queued), default=0.0)
        n = max(self.arrivals, 1)
        starting = tuple(w.role for w in workers if w.state is WorkerState.STARTING)
        return MetricsSnapshot(
            time_s=now, interval_s=interval_s, arrival_rate=self.arrivals / interval_s,
            mean_input_tokens=self.input_tokens / n, mean_output_tokens=self.output_tokens / n,
            queue_time_s=max(oldest, max(self.ttfts, default=0.0)), queued_requests=len(queued),
            ttft_s=sum(self.ttfts) / max(len(self.ttfts), 1), itl_s=sum(self.itls) / max(len(self.itls), 1),
            workers=tuple(_worker_snapshot(w) for w in serving), pending=starting + tuple(pending))


def _worker_snapshot(w: SimWorker) -> WorkerSnapshot:
    """The worker's interval as a live worker reports it; its interval counters start again."""
    busy = w.measured_busy_s
    tps = w.measured_prefill_tokens / busy if busy and w.role != DECODE else 0.0
    step = busy / w.measured_steps if w.measured_steps and w.role == DECODE else 0.0
    w.measured_busy_s, w.measured_prefill_tokens, w.measured_steps = 0.0, 0, 0
    return WorkerSnapshot(w.name, w.role, running=len(w.running), queued=len(w.queue) + len(w.waiting),
                          kv_usage=1 - w.kv_free_share(), prefill_tokens_per_s=tps, decode_step_s=step)


@dataclass(frozen=True)
class SimResult:
    requests: int
    completed: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    goodput: float            # share of all requests that finished within both SLOs
    mean_workers: float
    actions: int
    simulated_s: float

    def describe(self) -> str:
        return (f"requests {self.requests} (completed {self.completed}); TTFT p50 {self.ttft_p50_s * 1e3:.0f} ms, "
                f"p99 {self.ttft_p99_s * 1e3:.0f} ms; ITL p50 {self.itl_p50_s * 1e3:.1f} ms, p99 "
                f"{self.itl_p99_s * 1e3:.1f} ms; goodput {self.goodput:.1%}; mean workers {self.mean_workers:.1f}; "
                f"planner actions {self.actions}; simulated {self.simulated_s:.0f} s")


def summarize(requests: list[SimRequest], total: int, ttft_slo: float, itl_slo: float, mean_workers: float,
              actions: int, simulated_s: float) -> SimResult:
    done = [r for r in requests if r.done_s is not None]
    ttfts = [r.first_token_s - r.arrival_s for r in done]
    itls = [request_itl(r) for r in done if r.trace.output_tokens > 1]
    good = sum(1 for r in done if r.first_token_s - r.arrival_s <= ttft_slo and request_itl(r) <= itl_slo)
    return SimResult(total, len(done), percentile(ttfts, 50), percentile(ttfts, 99), percentile(itls, 50),
                     percentile(itls, 99), good / max(total, 1), mean_workers, actions, simulated_s)
