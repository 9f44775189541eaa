"""Every metric of the cluster, one prefix (`splitserve_`), Prometheus naming conventions.

The driver process owns the registry and serves it (`--metrics-port`); with several frontend
processes it sums their request series at scrape time. Request-level series
(latencies, tokens, finish reasons) are recorded by the router as it streams; worker-level series
(KV blocks, queues, prefix cache, KV transfer) come from the workers' periodic stats snapshots
through a collector, each labelled by worker, so one scrape target covers the whole cluster.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from cluster.worker_messages import WorkerStats, expect

PREFIX = "splitserve_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


SAMPLES_VERSION = 1


@dataclass(frozen=True)
class Sample:
    """One value of a metric family, with its labels (sorted by name)."""
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass(frozen=True)
class SampleFamily:
    """One metric family's samples as a frontend process sends them to the driver, which sums the
    frontends' at scrape time (`--frontends N`)."""
    name: str
    type: str
    documentation: str
    samples: tuple[Sample, ...]
    version: int = SAMPLES_VERSION


# The workers' series: (name without the prefix, help, the `WorkerStats` field it reads).
_ROLE_GAUGES = (
    ("kv_cache_blocks_in_use", "KV blocks held by requests (cached but unreferenced blocks count as free)",
     "blocks_used"),
    ("kv_cache_blocks", "KV blocks in the pool", "blocks_total"),
    ("num_requests_running", "requests in the running batch", "running"),
    ("num_requests_waiting", "requests queued", "waiting"),
)
_ROLE_COUNTERS = (
    ("prefix_cache_queries", "prompt blocks looked up in the prefix cache", "prefix_queries"),
    ("prefix_cache_hits", "prompt blocks found in the prefix cache", "prefix_hits"),
    ("prompt_tokens_computed", "prompt tokens run through the model (prefix-cache hits, transferred KV and the "
                               "shared prompt of n > 1 samples are not)", "prompt_tokens_computed"),
)
_DISCARDED = ("kv_discarded", "handed-off requests whose transferred KV was freed to be recomputed (KV pressure)",
              "kv_discarded")
# A decode worker's handoffs (`WorkerStats.handoff`, a `HandoffStats`), labelled by transport.
_HANDOFF_COUNTERS = (
    ("kv_transfer_bytes", "KV bytes received by handoff", "bytes"),
    ("kv_transfer_seconds", "time spent in KV handoffs (read, verify, ack)", "seconds"),
    ("kv_transfers", "KV handoffs completed", "done"),
    ("kv_transfer_failures", "KV handoffs that failed (recomputed locally)", "failed"),
    ("kv_transfers_declined", "KV handoffs a full decode worker declined (continued elsewhere or later)", "declined"),
)
# Per speculative method (`WorkerStats.spec`, `SpecStats`).
_SPEC_COUNTERS = (
    ("spec_draft_tokens", "speculative tokens proposed", "drafted"),
    ("spec_accepted_tokens", "speculative tokens accepted by verification", "accepted"),
    ("spec_verify_steps", "verification passes (one per drafted sequence)", "steps"),
    ("spec_emitted_tokens", "tokens emitted by verification passes (accepted + one per pass)", "emitted"),
)


def _families(kind, series, labels: list[str]) -> list[tuple]:
    """(family, the field it reads) for each series of a table."""
    return [(kind(PREFIX + name, text, labels=labels), field) for name, text, field in series]


class _WorkerCollector:
    """The workers' series, from each worker's last `WorkerStats`, labelled by worker."""

    def __init__(self, metrics: "ClusterMetrics"):
        self.metrics = metrics

    def collect(self):
        by_role = [*_families(GaugeMetricFamily, _ROLE_GAUGES, ["worker", "role"]),
                   *_families(CounterMetricFamily, _ROLE_COUNTERS, ["worker", "role"])]
        discarded = _families(CounterMetricFamily, (_DISCARDED,), ["worker", "role"])
        handoff = _families(CounterMetricFamily, _HANDOFF_COUNTERS, ["worker", "transport"])
        spec = _families(CounterMetricFamily, _SPEC_COUNTERS, ["worker", "method"])
        queue = SummaryMetricFamily(PREFIX + "request_queue_time_seconds",
                                    "time requests waited for their first schedule", labels=["worker", "role"])
        transport = self.metrics.transport
        for s in self.metrics.worker_stats.values():
            for family, field in (*by_role, *discarded):
                family.add_metric([s.name, s.role], getattr(s, field))
            queue.add_metric([s.name, s.role], count_value=s.queue_count, sum_value=s.queue_seconds)
            if s.handoff is not None:
                for family, field in handoff:
                    family.add_metric([s.name, transport], getattr(s.handoff, field))
            for counts in s.spec:
                for family, field in spec:
                    family.add_metric([s.name, counts.method], getattr(counts, field))
        yield from (f for f, _ in by_role)
        yield queue
        yield from (f for f, _ in (*handoff, *discarded, *spec))


class RequestTracker:
    def __init__(self, metrics: "ClusterMetrics", tenant: str = ""):
        self.m = metrics
        self.tenant = tenant or "anonymous"     # a tenant's name, never its key
        self.start = time.perf_counter()
        self.last = None
        self.first = None
        self.done = False

    def tokens(self, n: int, delta) -> None:
        now = time.perf_counter()
        if n:
            # One inter-token gap per token after the first, however the tokens were grouped into
            # messages (a lagging stream coalesces; tokens that arrive together are 0 s apart).
            if self.last is None:
                self.m.ttft.observe(now - self.start)
                self.first = now
                gaps, gap = n - 1, 0.0
            else:
                gaps, gap = n, (now - self.last) / n
            for _ in range(gaps):
                self.m.itl.observe(gap)
            self.m.tokens.labels(tenant=self.tenant).inc(n)
            self.last = now
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason.value, delta.num_prompt_tokens)

    def finish(self, reason: str, prompt_tokens: int = 0) -> None:
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        self.m.e2e.observe(now - self.start)
        if self.last is not None:
            self.m.decode_time.observe(self.last - (self.first or self.last))
        self.m.finished.labels(reason=reason, tenant=self.tenant).inc()
        if prompt_tokens:
            self.m.prompt_tokens.labels(tenant=self.tenant).inc(prompt_tokens)


class _FrontendCollector:
    """With several frontend processes (`--frontends N`), the request series live in each of them:
    one scrape of the driver sums them, so one target still covers the whole cluster."""

    def __init__(self, frontends: list):
        self.frontends = frontends

    def collect(self):
        import ray  # noqa: PLC0415
        from prometheus_client.metrics_core import Metric  # noqa: PLC0415
        merged: dict[str, tuple[str, str, dict]] = {}     # family -> (type, help, sample key -> sum)
        for families in ray.get([f.metric_samples.remote() for f in self.frontends], timeout=10):
            for family in families:
                family = expect(family, SampleFamily)
                _, _, values = merged.setdefault(family.name, (family.type, family.documentation, {}))
                for s in family.samples:
                    values[(s.name, s.labels)] = values.get((s.name, s.labels), 0.0) + s.value
        for name, (typ, doc, values) in merged.items():
            m = Metric(name, doc, typ)
            for (sample, labels), value in values.items():
                m.add_sample(sample, dict(labels), value)
            yield m


class ClusterMetrics:
    def __init__(self, transport: str, workers: bool = True, frontends: list | None = None):
        """`workers`: serve the workers' series (the driver). `frontends`: actor frontends whose
        request series this registry sums instead of recording its own."""
        self.registry = CollectorRegistry()
        self.transport = transport
        self.worker_stats: dict[str, WorkerStats] = {}
        self.has_workers = workers      # this registry holds the whole cluster's series
        r = self.registry
        if workers:
            r.register(_WorkerCollector(self))
        if frontends:
            r.register(_FrontendCollector(frontends))
            r = CollectorRegistry()      # this process records no request of its own
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "time between output tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "request latency, first byte in to last out",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.prefill_time = Histogram(PREFIX + "request_prefill_time_seconds", "prefill phase time (remote prefill)",
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.decode_time = Histogram(PREFIX + "request_decode_time_seconds", "decode phase: first to last token",
                                     registry=r, buckets=_LATENCY_BUCKETS)
        self.tokens = Counter(PREFIX + "generation_tokens", "output tokens streamed, by tenant", ["tenant"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished requests, by tenant",
                                     ["tenant"], registry=r)
        self.finished = Counter(PREFIX + "requests_finished", "requests finished, by reason and tenant",
                                ["reason", "tenant"], registry=r)
        self.refused = Counter(PREFIX + "requests_refused", "requests refused before any work (router/admission.py), "
                               "by reason and tenant", ["reason", "tenant"], registry=r)
        self.queued = Gauge(PREFIX + "admission_queue_depth", "requests waiting for an in-flight slot", registry=r)
        self._requests = r

    def request_samples(self) -> tuple[SampleFamily, ...]:
        """The request series, for the driver's merged scrape."""
        return tuple(SampleFamily(f.name, f.type, f.documentation,
                                  tuple(Sample(s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples
                                        if not s.name.endswith("_created")))
                     for f in self._requests.collect())

    def track(self, request) -> RequestTracker:
        return RequestTracker(self, getattr(request, "tenant", ""))

    def observe_prefill(self, seconds: float) -> None:
        self.prefill_time.observe(seconds)

    def update_worker(self, stats: WorkerStats) -> None:
        self.worker_stats[stats.name] = stats

    def serve(self, port: int, host: str = "127.0.0.1"):
        return start_http_server(port, addr=host, registry=self.registry)
