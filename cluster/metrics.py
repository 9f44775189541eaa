"""Every metric of the cluster, one prefix (`splitserve_`), Prometheus naming conventions.

The driver process owns the registry and serves it (`--metrics-port`); with several frontend
processes it sums their request series at scrape time. Request-level series
(latencies, tokens, finish reasons) are recorded by the router as it streams; worker-level series
(KV blocks, queues, prefix cache, KV transfer) come from the workers' periodic stats snapshots
through a collector, each labelled by worker, so one scrape target covers the whole cluster.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from cluster.worker_messages import WorkerStats

PREFIX = "splitserve_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _WorkerCollector:
    def __init__(self, metrics: "ClusterMetrics"):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.worker_stats
        g_blocks = GaugeMetricFamily(PREFIX + "kv_cache_blocks_in_use",
                                     "KV blocks held by requests (cached but unreferenced blocks count as free)",
                                     labels=["worker", "role"])
        g_total = GaugeMetricFamily(PREFIX + "kv_cache_blocks", "KV blocks in the pool", labels=["worker", "role"])
        g_running = GaugeMetricFamily(PREFIX + "num_requests_running", "requests in the running batch",
                                      labels=["worker", "role"])
        g_waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting", "requests queued", labels=["worker", "role"])
        c_queries = CounterMetricFamily(PREFIX + "prefix_cache_queries", "prompt blocks looked up in the prefix cache",
                                        labels=["worker", "role"])
        c_hits = CounterMetricFamily(PREFIX + "prefix_cache_hits", "prompt blocks found in the prefix cache",
                                     labels=["worker", "role"])
        c_bytes = CounterMetricFamily(PREFIX + "kv_transfer_bytes", "KV bytes received by handoff",
                                      labels=["worker", "transport"])
        c_secs = CounterMetricFamily(PREFIX + "kv_transfer_seconds", "time spent in KV handoffs (read, verify, ack)",
                                     labels=["worker", "transport"])
        c_done = CounterMetricFamily(PREFIX + "kv_transfers", "KV handoffs completed",
                                     labels=["worker", "transport"])
        c_fail = CounterMetricFamily(PREFIX + "kv_transfer_failures", "KV handoffs that failed (recomputed locally)",
                                     labels=["worker", "transport"])
        c_declined = CounterMetricFamily(PREFIX + "kv_transfers_declined",
                                         "KV handoffs a full decode worker declined (continued elsewhere or later)",
                                         labels=["worker", "transport"])
        c_discarded = CounterMetricFamily(PREFIX + "kv_discarded",
                                          "handed-off requests whose transferred KV was freed to be recomputed "
                                          "(KV pressure)", labels=["worker", "role"])
        c_prompt = CounterMetricFamily(PREFIX + "prompt_tokens_computed",
                                       "prompt tokens run through the model (prefix-cache hits, transferred KV and "
                                       "the shared prompt of n > 1 samples are not)", labels=["worker", "role"])
        queue = SummaryMetricFamily(PREFIX + "request_queue_time_seconds",
                                    "time requests waited for their first schedule", labels=["worker", "role"])
        spec = {key: CounterMetricFamily(PREFIX + name, text, labels=["worker", "method"]) for key, name, text in (
            ("drafted", "spec_draft_tokens", "speculative tokens proposed"),
            ("accepted", "spec_accepted_tokens", "speculative tokens accepted by verification"),
            ("steps", "spec_verify_steps", "verification passes (one per drafted sequence)"),
            ("emitted", "spec_emitted_tokens", "tokens emitted by verification passes (accepted + one per pass)"))}
        transport = self.metrics.transport
        for s in stats.values():
            for counts in s.spec:
                for key, family in spec.items():
                    family.add_metric([s.name, counts.method], getattr(counts, key))
            w, r = s.name, s.role
            g_blocks.add_metric([w, r], s.blocks_used)
            g_total.add_metric([w, r], s.blocks_total)
            g_running.add_metric([w, r], s.running)
            g_waiting.add_metric([w, r], s.waiting)
            c_queries.add_metric([w, r], s.prefix_queries)
            c_hits.add_metric([w, r], s.prefix_hits)
            c_prompt.add_metric([w, r], s.prompt_tokens_computed)
            queue.add_metric([w, r], count_value=s.queue_count, sum_value=s.queue_seconds)
            c_discarded.add_metric([w, r], s.kv_discarded)
            if s.handoff is not None:
                c_declined.add_metric([w, transport], s.handoff.declined)
                c_bytes.add_metric([w, transport], s.handoff.bytes)
                c_secs.add_metric([w, transport], s.handoff.seconds)
                c_done.add_metric([w, transport], s.handoff.done)
                c_fail.add_metric([w, transport], s.handoff.failed)
        yield from (g_blocks, g_total, g_running, g_waiting, c_queries, c_hits, c_prompt, queue, c_bytes, c_secs, c_done,
                    c_fail, c_declined, c_discarded, *spec.values())


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
        merged: dict[str, tuple[str, str, dict]] = {}
        for families in ray.get([f.metric_samples.remote() for f in self.frontends], timeout=10):
            for name, typ, doc, samples in families:
                _, _, values = merged.setdefault(name, (typ, doc, {}))
                for sample, labels, value in samples:
                    k = (sample, tuple(sorted(labels.items())))
                    values[k] = values.get(k, 0.0) + value
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

    def request_samples(self) -> list:
        """The request series as plain data: (name, type, help, [(sample, labels, value)])."""
        return [(f.name, f.type, f.documentation, [(s.name, dict(s.labels), s.value) for s in f.samples
                                                   if not s.name.endswith("_created")])
                for f in self._requests.collect()]

    def track(self, request) -> RequestTracker:
        return RequestTracker(self, getattr(request, "tenant", ""))

    def observe_prefill(self, seconds: float) -> None:
        self.prefill_time.observe(seconds)

    def update_worker(self, stats: WorkerStats) -> None:
        self.worker_stats[stats.name] = stats

    def serve(self, port: int, host: str = "127.0.0.1"):
        return start_http_server(port, addr=host, registry=self.registry)
