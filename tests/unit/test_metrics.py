"""The metrics, scraped as Prometheus would (cluster/metrics.py): worker series from a fake
`WorkerStats` (KV usage ratio, preemptions, the queue-time histogram), the request lengths a
`RequestTracker` records, `model_name` on every series, no `_created` series; and the scheduler's
counts that feed them (queue-time buckets, preemptions), over a real block pool and no model."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import SchedulerConfig
from cluster.engine.scheduler import QUEUE_TIME_BUCKETS, Scheduler
from cluster.engine.sequence import Sequence
from cluster.kv.block_pool import BlockPool
from cluster.metrics import ClusterMetrics, ReportCount
from cluster.types import FinishReason, GenerateRequest, SamplingParams, TokenDelta
from cluster.worker_messages import HandoffStats, StatsSource, WorkerStats

MODEL = "served-name"


def _scrape(metrics: ClusterMetrics) -> tuple[str, dict[tuple[str, frozenset], float]]:
    """The exposition text, and each sample's value by (name, labels)."""
    text = generate_latest(metrics.registry).decode()
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    return text, samples


def _value(samples, name: str, **labels) -> float:
    return samples[name, frozenset({"model_name": MODEL, **labels}.items())]


class _Workers:
    """What the metrics read the workers' series from (in the driver, router/worker_pool.py
    `WorkerPool`): each worker's newest stats, and the stats each sent by channel."""

    def __init__(self, *stats: WorkerStats, reports: tuple[ReportCount, ...] = ()):
        self.stats = {s.name: s for s in stats}
        self.reports = list(reports)

    def latest_stats(self) -> dict[str, WorkerStats]:
        return self.stats

    def report_counts(self) -> list[ReportCount]:
        return self.reports


def _decode_stats(**fields) -> WorkerStats:
    return WorkerStats(name="decode-0", role="decode", incarnation="i", ready=True,
                       handoff=HandoffStats(done=2, bytes=4096), **fields)


def test_worker_series_read_kv_ratio_preemptions_and_queue_histogram():
    m = ClusterMetrics("nixl", MODEL, workers=_Workers(
        _decode_stats(blocks_used=3, blocks_total=12, preemptions=2, queue_count=4, queue_seconds=0.5,
                      queue_time_buckets=((0.001, 1), (0.01, 3), (0.1, 3))),
        WorkerStats(name="prefill-0", role="prefill", incarnation="i", ready=True)))   # an empty pool
    _, samples = _scrape(m)
    worker = {"worker": "decode-0", "role": "decode"}
    assert _value(samples, "splitserve_kv_cache_usage_ratio", **worker) == 0.25
    assert _value(samples, "splitserve_kv_cache_usage_ratio", worker="prefill-0", role="prefill") == 0.0
    assert _value(samples, "splitserve_kv_cache_blocks_in_use", **worker) == 3
    assert _value(samples, "splitserve_num_preemptions_total", **worker) == 2
    assert _value(samples, "splitserve_num_preemptions_total", worker="prefill-0", role="prefill") == 0
    buckets = {le: _value(samples, "splitserve_request_queue_time_seconds_bucket", le=le, **worker)
               for le in ("0.001", "0.01", "0.1", "+Inf")}
    assert buckets == {"0.001": 1, "0.01": 3, "0.1": 3, "+Inf": 4}
    assert _value(samples, "splitserve_request_queue_time_seconds_count", **worker) == 4
    assert _value(samples, "splitserve_request_queue_time_seconds_sum", **worker) == 0.5
    assert _value(samples, "splitserve_kv_transfers_total", worker="decode-0", transport="nixl") == 2


def test_queue_histogram_stays_monotonic_when_read_mid_count():
    """Counts read while the engine counts: a bucket newer than `queue_count` lifts +Inf with it."""
    m = ClusterMetrics("nixl", MODEL, workers=_Workers(_decode_stats(queue_count=2,
                                                                     queue_time_buckets=((0.001, 1), (0.01, 3)))))
    _, samples = _scrape(m)
    assert _value(samples, "splitserve_request_queue_time_seconds_bucket", worker="decode-0", role="decode",
                  le="+Inf") == 3


def test_stats_reports_are_counted_by_worker_and_channel():
    """`splitserve_worker_stats_reports_total` reads the pool's counts: one series per worker and
    channel that sent any (the driver of several frontends hears no push)."""
    m = ClusterMetrics("nixl", MODEL, workers=_Workers(_decode_stats(), reports=(
        ReportCount("decode-0", StatsSource.POLL, 3), ReportCount("decode-0", StatsSource.PUSH, 7))))
    _, samples = _scrape(m)
    assert _value(samples, "splitserve_worker_stats_reports_total", worker="decode-0", source="poll") == 3
    assert _value(samples, "splitserve_worker_stats_reports_total", worker="decode-0", source="push") == 7
    assert not [key for key in samples if key[0] == "splitserve_worker_stats_reports_total"
                and ("worker", "prefill-0") in key[1]]
    assert ClusterMetrics("nixl", MODEL).worker_stats == {}          # a frontend process: no worker series


def _delta(rid: str, n: int, finish: FinishReason | None = None, prompt: int = 0) -> TokenDelta:
    return TokenDelta(rid, tuple(range(n)), "x" * n, finish, (), prompt)


def test_tracker_records_lengths_per_finished_request_with_model_name():
    m = ClusterMetrics("tcp", MODEL)
    req = GenerateRequest("r1", tuple(range(7)), SamplingParams(max_tokens=8), tenant="alpha")
    t = m.track(req)
    t.tokens(3, _delta("r1", 3))
    t.tokens(2, _delta("r1", 2, FinishReason.LENGTH, prompt=7))
    # Aborted before any token and before a worker reported its prompt: the router's own length.
    m.track(GenerateRequest("r2", tuple(range(40)), SamplingParams(max_tokens=8))).finish("abort")
    _, samples = _scrape(m)
    assert _value(samples, "splitserve_request_prompt_tokens_count") == 2
    assert _value(samples, "splitserve_request_prompt_tokens_sum") == 47
    assert _value(samples, "splitserve_request_prompt_tokens_bucket", le="5.0") == 0
    assert _value(samples, "splitserve_request_prompt_tokens_bucket", le="10.0") == 1
    assert _value(samples, "splitserve_request_prompt_tokens_bucket", le="50.0") == 2
    assert _value(samples, "splitserve_request_generation_tokens_count") == 2
    assert _value(samples, "splitserve_request_generation_tokens_sum") == 5
    assert _value(samples, "splitserve_request_generation_tokens_bucket", le="1.0") == 1     # the abort: 0
    assert _value(samples, "splitserve_requests_finished_total", reason="length", tenant="alpha") == 1
    assert _value(samples, "splitserve_requests_finished_total", reason="abort", tenant="anonymous") == 1
    assert _value(samples, "splitserve_generation_tokens_total", tenant="alpha") == 5
    assert _value(samples, "splitserve_time_to_first_token_seconds_count") == 1


def test_every_series_carries_model_name_and_none_is_created():
    m = ClusterMetrics("tcp", MODEL, workers=_Workers(_decode_stats(blocks_total=4),
                                                      reports=(ReportCount("decode-0", StatsSource.PUSH, 2),)))
    t = m.track(GenerateRequest("r1", (1, 2, 3), SamplingParams(max_tokens=2)))
    t.tokens(2, _delta("r1", 2, FinishReason.STOP, prompt=3))
    m.observe_prefill(0.01)
    m.count_refused("queue_full", "")
    m.set_admission_queue_depth("", 1)
    text, samples = _scrape(m)
    assert samples and all(dict(labels).get("model_name") == MODEL for _, labels in samples)
    assert "_created" not in text
    families = m.request_samples()
    assert {f.name for f in families} >= {"splitserve_request_prompt_tokens", "splitserve_admission_queue_depth"}
    assert not [s.name for f in families for s in f.samples if s.name.endswith("_created")]


# --- the scheduler's counts ----------------------------------------------------------------------
BS = 4


def _plain(s: Scheduler, rid: str, n: int, max_tokens: int) -> Sequence:
    seq = Sequence(rid, tuple(10 + i for i in range(n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    s.add(seq)
    return seq


def test_scheduler_counts_queue_time_into_prometheus_buckets():
    s = Scheduler(SchedulerConfig(), BlockPool(8), BS, 256, (1,))
    for seconds in (0.0005, 0.001, 0.003, 100.0):
        s._count_queue_time(seconds)
    buckets = dict(s.queue_time_buckets())
    assert tuple(buckets) == QUEUE_TIME_BUCKETS
    assert (buckets[0.001], buckets[0.0025], buckets[0.005], buckets[80.0]) == (2, 2, 3, 3)   # le: bound included
    assert s.queue_count == 4 and s.queue_seconds == pytest.approx(100.0045)


def test_scheduler_counts_preemptions_and_queue_time_once_per_request():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockPool(4, enable_prefix_caching=False), BS, 256,
                  (1,))
    seqs = [_plain(s, "a", 6, 8), _plain(s, "b", 6, 8)]      # 2 blocks each: the pool is full once both decode
    for _ in range(100):
        if not s.has_unfinished():
            break
        plan = s.schedule()
        s.update(plan, {c.seq: [5] for c in plan.chunks if c.samples})
    assert all(q.finish_reason is FinishReason.LENGTH for q in seqs)
    assert s.num_preemptions == sum(q.num_preemptions for q in seqs) > 0
    assert s.queue_count == 2 == dict(s.queue_time_buckets())[QUEUE_TIME_BUCKETS[-1]]
    assert s.pool.num_free == 4


def test_acceptance_by_draft_position_is_a_series_per_position():
    from cluster.worker_messages import SpecStats
    m = ClusterMetrics("nixl", MODEL, workers=_Workers(
        _decode_stats(spec=(SpecStats("eagle", 7, 4, 3, 7, drafted_at=(3, 3, 1), accepted_at=(3, 1, 0)),))))
    _, samples = _scrape(m)
    at = {p: (_value(samples, "splitserve_spec_position_draft_tokens_total", worker="decode-0", method="eagle", position=p),
              _value(samples, "splitserve_spec_position_accepted_tokens_total", worker="decode-0", method="eagle",
                         position=p))
          for p in ("1", "2", "3")}
    assert at == {"1": (3, 3), "2": (3, 1), "3": (1, 0)}
