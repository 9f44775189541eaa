"""Every metric of the cluster, one prefix (`splitserve_`), Prometheus naming conventions, and
vLLM's labels where it has them: every series carries `model_name` (the served model name).

The driver process owns the registry and serves it (`--metrics-port`); with several frontend
processes it sums their request series at scrape time. Request-level series
(latencies, lengths, tokens, finish reasons, admission) are recorded by the router as it streams;
worker-level series (KV blocks, queues, preemptions, prefix cache, KV transfer) come from the
workers' stats snapshots through a collector that reads them, at each scrape, from the driver's
`WorkerPool` (router/worker_pool.py, their one owner: a `WorkerStatsSource` here), each labelled
by worker, so one scrape target covers the whole cluster. docs/deploy.md maps vLLM's metric names
to these.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from cluster.worker_messages import StatsSource, WorkerStats, expect

# No `_created` series (a creation timestamp per counter and histogram, which no dashboard reads and
# which doubles their series). prometheus_client's switch is process-wide: set where every metric
# of the process is defined, so both /metrics endpoints (--metrics-port, the HTTP API) lack them.
disable_created_metrics()

PREFIX = "splitserve_"
ANONYMOUS = "anonymous"     # the tenant of requests to a server without API keys
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# Token counts per request, 1-2-5 per decade as vLLM's request_prompt_tokens / generation_tokens
# (vLLM stops at max_model_len; a fixed ladder keeps every deployment's buckets summable).
_LENGTH_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5)) + (1_000_000,)


def tenant_label(tenant: str) -> str:
    """The `tenant` label of a request's tenant ("" without API keys)."""
    return tenant or ANONYMOUS


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


@dataclass(frozen=True)
class ReportCount:
    """How many stats one worker has sent by one channel (`splitserve_worker_stats_reports_total`)."""
    worker: str
    source: StatsSource
    count: int


class WorkerStatsSource(Protocol):
    """Where the workers' series are read: router/worker_pool.py `WorkerPool`, the one owner of each
    worker's stats in the process that serves the metrics (the driver)."""

    def latest_stats(self) -> Mapping[str, WorkerStats]:
        """Worker -> its newest stats."""

    def report_counts(self) -> list[ReportCount]:
        """The stats each worker has sent, by channel."""


# The workers' series: (name without the prefix, help, the `WorkerStats` field it reads).
_ROLE_GAUGES = (
    ("kv_cache_blocks_in_use", "KV blocks held by requests (cached but unreferenced blocks count as free)",
     "blocks_used"),
    ("kv_cache_blocks", "KV blocks in the pool", "blocks_total"),
    ("kv_cache_usage_ratio", "KV blocks held by requests over the pool, 0..1 (vLLM: kv_cache_usage_perc)",
     "kv_usage"),
    ("num_requests_running", "requests in the running batch", "running"),
    ("num_requests_waiting", "requests queued", "waiting"),
)
_ROLE_COUNTERS = (
    ("prefix_cache_queries", "prompt blocks looked up in the prefix cache", "prefix_queries"),
    ("prefix_cache_hits", "prompt blocks found in the prefix cache", "prefix_hits"),
    ("prompt_tokens_computed", "prompt tokens run through the model (prefix-cache hits, transferred KV and the "
                               "shared prompt of n > 1 samples are not)", "prompt_tokens_computed"),
    ("num_preemptions", "requests preempted for KV blocks (their blocks freed, their tokens recomputed)",
     "preemptions"),
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
    ("spec_tree_draft_tokens", "token-tree leaves verified beside the drafts' chains", "tree_drafted"),
    ("spec_tree_accepted_tokens", "token-tree leaves accepted (tokens the chains alone would have missed)",
     "tree_accepted"),
)
# Per speculative method and draft position (1 = the first drafted token): acceptance by position.
_SPEC_POSITION_COUNTERS = (
    ("spec_position_draft_tokens", "drafted tokens at this draft position", "drafted_at"),
    ("spec_position_accepted_tokens", "drafted tokens at this draft position that verification accepted",
     "accepted_at"),
)


def _families(kind, series, labels: list[str]) -> list[tuple]:
    """(family, the field it reads) for each series of a table."""
    return [(kind(PREFIX + name, text, labels=labels), field) for name, text, field in series]


def queue_time_buckets(s: WorkerStats) -> list[tuple[str, float]]:
    """A worker's queue-time histogram as Prometheus buckets (`le`, cumulative count), +Inf last.
    The counts are read while the engine thread counts: +Inf never falls below a finite bucket."""
    buckets = [(floatToGoString(le), count) for le, count in s.queue_time_buckets]
    return [*buckets, ("+Inf", max([s.queue_count, *(count for _, count in buckets)]))]


class _WorkerCollector:
    """The workers' series, from each worker's last `WorkerStats`, labelled by worker and model."""

    def __init__(self, metrics: "ClusterMetrics"):
        self.metrics = metrics

    def collect(self):
        by_role = [*_families(GaugeMetricFamily, _ROLE_GAUGES, ["worker", "role", "model_name"]),
                   *_families(CounterMetricFamily, _ROLE_COUNTERS, ["worker", "role", "model_name"])]
        discarded = _families(CounterMetricFamily, (_DISCARDED,), ["worker", "role", "model_name"])
        handoff = _families(CounterMetricFamily, _HANDOFF_COUNTERS, ["worker", "transport", "model_name"])
        spec = _families(CounterMetricFamily, _SPEC_COUNTERS, ["worker", "method", "model_name"])
        by_position = _families(CounterMetricFamily, _SPEC_POSITION_COUNTERS,
                                ["worker", "method", "position", "model_name"])
        heads = [(GaugeMetricFamily(PREFIX + "spec_head_version", "the live EAGLE head version per tenant "
                                    "(--spec-online; 0: the base head)", labels=["worker", "tenant", "model_name"]),
                  "version"),
                 (CounterMetricFamily(PREFIX + "spec_head_swaps", "EAGLE head swaps per tenant (--spec-online)",
                                      labels=["worker", "tenant", "model_name"]), "swaps"),
                 (CounterMetricFamily(PREFIX + "spec_head_rollbacks", "EAGLE head swaps per tenant that rolled back "
                                      "a promoted head (--spec-online)", labels=["worker", "tenant", "model_name"]),
                  "rollbacks")]
        tiers = _tier_families()
        experts = CounterMetricFamily(PREFIX + "expert_tokens", "tokens routed to each expert of a mixture-of-"
                                      "experts layer (a token counts once per chosen expert), by worker and role",
                                      labels=["worker", "role", "layer", "expert", "model_name"])
        rank_pairs = CounterMetricFamily(PREFIX + "expert_rank_tokens", "(token, expert) pairs each rank of an "
                                         "expert-parallel worker ran, by layer: the balance --enable-eplb improves",
                                         labels=["worker", "role", "layer", "rank", "model_name"])
        rebalances = CounterMetricFamily(PREFIX + "expert_rebalances", "expert placements the balancer applied "
                                         "(--enable-eplb)", labels=["worker", "role", "model_name"])
        reports = CounterMetricFamily(PREFIX + "worker_stats_reports", "worker stats the driver read, by worker "
                                      "and source (poll: a Ray call; push: over the token stream while the "
                                      "worker steps)", labels=["model_name", "worker", "source"])
        queue = HistogramMetricFamily(PREFIX + "request_queue_time_seconds",
                                      "time requests waited on a worker for their first schedule",
                                      labels=["worker", "role", "model_name"])
        workers = GaugeMetricFamily(PREFIX + "workers", "workers in the cluster now, by role (admin operations "
                                    "and SIGTERM change them)", labels=["model_name", "role"])
        transport, model = self.metrics.transport, self.metrics.model_name
        roles = [s.role for s in self.metrics.worker_stats.values()]
        for role in ("prefill", "decode", *sorted(set(roles) - {"prefill", "decode"})):
            workers.add_metric([model, role], roles.count(role))
        for r in self.metrics.workers.report_counts():
            reports.add_metric([model, r.worker, r.source.value], r.count)
        for s in self.metrics.worker_stats.values():
            for family, field in (*by_role, *discarded):
                family.add_metric([s.name, s.role, model], getattr(s, field))
            queue.add_metric([s.name, s.role, model], queue_time_buckets(s), s.queue_seconds)
            if s.handoff is not None:
                for family, field in handoff:
                    family.add_metric([s.name, transport, model], getattr(s.handoff, field))
            if s.tiers is not None:
                _add_tiers(tiers, s, model)
            for layer, counts in s.expert_tokens:
                for expert, count in enumerate(counts):
                    experts.add_metric([s.name, s.role, str(layer), str(expert), model], count)
            for layer, counts in s.expert_rank_tokens:
                for rank, count in enumerate(counts):
                    rank_pairs.add_metric([s.name, s.role, str(layer), str(rank), model], count)
            if s.expert_rank_tokens:
                rebalances.add_metric([s.name, s.role, model], s.expert_rebalances)
            for head in s.spec_heads:
                for family, field in heads:
                    family.add_metric([s.name, tenant_label(head.tenant), model], getattr(head, field))
            for counts in s.spec:
                for family, field in spec:
                    family.add_metric([s.name, counts.method, model], getattr(counts, field))
                for family, field in by_position:
                    for i, value in enumerate(getattr(counts, field)):
                        family.add_metric([s.name, counts.method, str(i + 1), model], value)
        yield from (f for f, _ in by_role)
        yield queue
        yield from (f for f, _ in (*handoff, *discarded, *spec, *by_position, *heads))
        yield from tiers.values()
        yield from (experts, rank_pairs, rebalances)
        yield reports
        yield workers


def _tier_families() -> dict:
    labels = ["worker", "tier", "model_name"]
    return {
        "blocks": GaugeMetricFamily(PREFIX + "kv_tier_blocks", "KV blocks a tier below the pool holds", labels=labels),
        "capacity": GaugeMetricFamily(PREFIX + "kv_tier_capacity_blocks", "KV blocks a tier can hold", labels=labels),
        "loaded": CounterMetricFamily(PREFIX + "kv_tier_loaded_blocks", "KV blocks loaded back into the pool from "
                                      "a tier for a prefix hit (prompt tokens not recomputed: x block size)",
                                      labels=labels),
        "offloaded": CounterMetricFamily(PREFIX + "kv_tier_offloaded_blocks", "KV blocks copied down from the pool",
                                         labels=["worker", "model_name"]),
        "corrupt": CounterMetricFamily(PREFIX + "kv_tier_corrupt_blocks", "KV blocks from a tier that failed their "
                                       "checksum (dropped and recomputed, never served)", labels=["worker", "model_name"]),
    }


def _add_tiers(families: dict, s: WorkerStats, model: str) -> None:
    t = s.tiers
    for tier, held, capacity, loaded in (("host", t.host_blocks, t.host_capacity, t.loaded_host),
                                         ("disk", t.disk_blocks, t.disk_capacity, t.loaded_disk)):
        families["blocks"].add_metric([s.name, tier, model], held)
        families["capacity"].add_metric([s.name, tier, model], capacity)
        families["loaded"].add_metric([s.name, tier, model], loaded)
    families["offloaded"].add_metric([s.name, model], t.offloaded)
    families["corrupt"].add_metric([s.name, model], t.corrupt)


class RequestTracker:
    """One request's series, recorded as the router streams it: latencies as tokens arrive, then
    its lengths and finish reason once, when it ends."""

    def __init__(self, metrics: "ClusterMetrics", tenant: str = "", prompt_tokens: int = 0):
        """`prompt_tokens`: the prompt's length as the router tokenized it (a request that ends
        before any worker reports its length still has one)."""
        self.m = metrics
        self.tenant = tenant_label(tenant)      # a tenant's name, never its key
        self.prompt_tokens = prompt_tokens
        self.generated = 0
        self.output_tokens = metrics.tokens.labels(model_name=metrics.model_name, tenant=self.tenant)
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
            self.output_tokens.inc(n)
            self.generated += n
            self.last = now
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason.value, delta.num_prompt_tokens)

    def finish(self, reason: str, prompt_tokens: int = 0) -> None:
        """`prompt_tokens`: the prompt's length as the worker counted it (0: not reported)."""
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        m, model = self.m, self.m.model_name
        m.e2e.observe(now - self.start)
        if self.last is not None:
            m.decode_time.observe(self.last - (self.first or self.last))
        m.finished.labels(model_name=model, reason=reason, tenant=self.tenant).inc()
        if prompt_tokens:
            m.prompt_tokens.labels(model_name=model, tenant=self.tenant).inc(prompt_tokens)
        m.prompt_length.observe(prompt_tokens or self.prompt_tokens)
        m.generation_length.observe(self.generated)


class _FrontendCollector:
    """With several frontend processes (`--frontends N`), the request series live in each of them:
    one scrape of the driver sums them, so one target still covers the whole cluster."""

    def __init__(self, frontends: list):
        self.frontends = frontends

    def collect(self):
        import ray  # noqa: PLC0415 - the router's modules import no ray (this runs in the driver only)
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


class _MergedCollector:
    """Several models in one cluster: each model's registry (its series labelled with its
    `model_name`) read as one, a family's samples from every registry under one HELP and TYPE."""

    def __init__(self, registries: list[CollectorRegistry]):
        self.registries = registries

    def collect(self):
        merged: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    merged[family.name] = family
                else:
                    into.samples.extend(family.samples)
        yield from merged.values()


def merged_registry(registries: list[CollectorRegistry]) -> CollectorRegistry:
    """One registry that serves all of `registries`' series (one scrape for a cluster of several models)."""
    out = CollectorRegistry()
    out.register(_MergedCollector(registries))
    return out


class ClusterMetrics:
    def __init__(self, transport: str, model_name: str, workers: WorkerStatsSource | None = None,
                 frontends: list | None = None):
        """`model_name`: the served model name (`--served-model-name`, else the model's id; the
        router's `Limits.model_id`), a label of every series. `workers`: where the workers' series
        are read, read at each scrape (the driver's `WorkerPool`; None: no worker series, a frontend
        process). `frontends`: actor frontends whose request series this registry sums instead
        of recording its own."""
        self.registry = CollectorRegistry()
        self.transport = transport
        self.model_name = model_name
        self.workers = workers
        self.has_workers = workers is not None      # this registry holds the whole cluster's series
        r = self.registry
        if workers is not None:
            r.register(_WorkerCollector(self))
        if frontends:
            r.register(_FrontendCollector(frontends))
            r = CollectorRegistry()      # this process records no request of its own
        self._requests = r
        self.ttft = self._histogram("time_to_first_token_seconds", "time to first token")
        self.itl = self._histogram("inter_token_latency_seconds", "time between output tokens")
        self.e2e = self._histogram("e2e_request_latency_seconds", "request latency, first byte in to last out")
        self.prefill_time = self._histogram("request_prefill_time_seconds", "prefill phase time (remote prefill)")
        self.decode_time = self._histogram("request_decode_time_seconds", "decode phase: first to last token")
        self.prompt_length = self._histogram("request_prompt_tokens", "prompt tokens per finished request",
                                             _LENGTH_BUCKETS)
        self.generation_length = self._histogram("request_generation_tokens",
                                                 "output tokens per finished request (each sample of n)",
                                                 _LENGTH_BUCKETS)
        by_tenant = ["model_name", "tenant"]
        self.tokens = Counter(PREFIX + "generation_tokens", "output tokens streamed, by tenant", by_tenant, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished requests, by tenant",
                                     by_tenant, registry=r)
        self.finished = Counter(PREFIX + "requests_finished", "requests finished, by reason and tenant",
                                ["model_name", "reason", "tenant"], registry=r)
        self.refused = Counter(PREFIX + "requests_refused", "requests refused before any work (router/admission.py), "
                               "by reason and tenant", ["model_name", "reason", "tenant"], registry=r)
        self.model_loads = Counter(PREFIX + "model_loads", "times a worker loaded its model's weights again after "
                                   "releasing them (--max-loaded-models)", ["worker", "model_name"], registry=r)
        self.queued = Gauge(PREFIX + "admission_queue_depth", "requests waiting for an in-flight slot, by tenant",
                            by_tenant, registry=r)
        self.prefills = Counter(PREFIX + "prefills", "prompts prefilled, by where and why (handoff: on a prefill "
                                "worker, KV moved; short, cached, colocated, no_prefill_worker: on the decode "
                                "worker)", ["model_name", "place"], registry=r)

        self.kv_index_stale = Gauge(PREFIX + "router_kv_index_stale", "1 when the router has read no KV events "
                                    "from this worker lately and routes on its load alone (summed over frontends: "
                                    "how many of them)", ["model_name", "worker"], registry=r)
        self.kv_index_blocks = Gauge(PREFIX + "router_kv_index_blocks", "blocks the router's KV index holds for the "
                                     "worker, by tier (a shared host tier counts for each worker of it; summed over "
                                     "frontends)", ["model_name", "worker", "tier"], registry=r)
        self.kv_index_reads = Gauge(PREFIX + "router_kv_index_reads", "KV event batches applied to the router's "
                                    "index, by kind (events: changes; snapshot: a full resync after a restart or "
                                    "a gap)", ["model_name", "kind"], registry=r)
        self.scaling_actions = Counter(PREFIX + "scaling_actions", "admin operations done on the running cluster, "
                                       "by action (add, remove, switch)", ["model_name", "action"], registry=r)
        self.drained = Counter(PREFIX + "drained_sequences", "sequences on a worker being drained, by outcome "
                               "(moved: KV to a peer; recomputed: resumed elsewhere from their streamed tokens; "
                               "finished: ended there)", ["model_name", "outcome"], registry=r)
        for action in ("add", "remove", "switch"):       # zero from the start: a dashboard reads them
            self.scaling_actions.labels(model_name=model_name, action=action)
        for outcome in ("moved", "recomputed", "finished"):
            self.drained.labels(model_name=model_name, outcome=outcome)

    def count_scaling(self, action: str) -> None:
        self.scaling_actions.labels(model_name=self.model_name, action=action).inc()

    def count_drained(self, outcome: str, n: int = 1) -> None:
        """Sequences a drain handed on (router/attempts.py) or let end (cluster/launch/admin.py)."""
        self.drained.labels(model_name=self.model_name, outcome=outcome).inc(n)

    def update_kv_index(self, per_worker: dict, counts: dict) -> None:
        """The router's cluster-wide KV index (router/kv_index.py): staleness and size per worker."""
        for worker, (stale, pool, host, disk) in per_worker.items():
            self.kv_index_stale.labels(model_name=self.model_name, worker=worker).set(int(stale))
            for tier, n in (("pool", pool), ("host", host), ("disk", disk)):
                self.kv_index_blocks.labels(model_name=self.model_name, worker=worker, tier=tier).set(n)
        for kind, n in counts.items():
            self.kv_index_reads.labels(model_name=self.model_name, kind=kind).set(n)

    def _histogram(self, name: str, text: str, buckets: tuple = _LATENCY_BUCKETS):
        """A request histogram of this model (its one label bound)."""
        family = Histogram(PREFIX + name, text, ["model_name"], registry=self._requests, buckets=buckets)
        return family.labels(model_name=self.model_name)

    def request_samples(self) -> tuple[SampleFamily, ...]:
        """The request series, for the driver's merged scrape."""
        return tuple(SampleFamily(f.name, f.type, f.documentation,
                                  tuple(Sample(s.name, tuple(sorted(s.labels.items())), s.value) for s in f.samples))
                     for f in self._requests.collect())

    def track(self, request) -> RequestTracker:
        return RequestTracker(self, getattr(request, "tenant", ""), len(getattr(request, "prompt_token_ids", ())))

    def observe_prefill(self, seconds: float) -> None:
        self.prefill_time.observe(seconds)

    def count_prefill(self, place: str) -> None:
        """One prompt's prefill placed (router/router.py `PrefillPlace`); n samples count once."""
        self.prefills.labels(model_name=self.model_name, place=place).inc()

    def count_refused(self, reason: str, tenant: str) -> None:
        """A request admission refused (router/admission.py)."""
        self.refused.labels(model_name=self.model_name, reason=reason, tenant=tenant_label(tenant)).inc()

    def set_admission_queue_depth(self, tenant: str, depth: int) -> None:
        """Requests of `tenant` waiting for in-flight slots in this frontend."""
        self.queued.labels(model_name=self.model_name, tenant=tenant_label(tenant)).set(depth)

    @property
    def worker_stats(self) -> Mapping[str, WorkerStats]:
        """Worker -> its newest stats, as the source holds them (none without one)."""
        return self.workers.latest_stats() if self.workers is not None else {}

    def serve(self, port: int, host: str = "127.0.0.1", registry: CollectorRegistry | None = None):
        """`registry`: another to serve instead (several models' merged: `merged_registry`)."""
        return start_http_server(port, addr=host, registry=registry or self.registry)
