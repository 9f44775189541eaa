"""Expert load in the metrics: a worker's per-expert token counts (WorkerStats.expert_tokens) cross
the token stream's stats frame intact and are exported as `splitserve_expert_tokens_total{layer,
expert,role}` per worker; a malformed frame is refused by name."""
from __future__ import annotations

import msgpack
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import ClusterMetrics
from cluster.worker_messages import WorkerStats, stats_from_wire, stats_to_wire

MODEL = "moe-model"


class _Workers:
    def __init__(self, *stats: WorkerStats):
        self.stats = {s.name: s for s in stats}

    def latest_stats(self):
        return self.stats

    def report_counts(self):
        return []


def _stats(name: str, role: str, expert_tokens) -> WorkerStats:
    return WorkerStats(name=name, role=role, incarnation="i", ready=True, expert_tokens=expert_tokens)


def test_expert_tokens_are_exported_per_layer_expert_and_role():
    m = ClusterMetrics("nixl", MODEL, workers=_Workers(_stats("prefill-0", "prefill", ((0, (5, 0, 7)), (2, (1, 1, 10)))),
                                                       _stats("decode-0", "decode", ((0, (0, 3, 1)),))))
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}

    def value(**labels):
        return samples["splitserve_expert_tokens_total", frozenset({"model_name": MODEL, **labels}.items())]
    assert value(worker="prefill-0", role="prefill", layer="0", expert="2") == 7
    assert value(worker="prefill-0", role="prefill", layer="2", expert="2") == 10
    assert value(worker="decode-0", role="decode", layer="0", expert="1") == 3
    assert not [k for k in samples if k[0] == "splitserve_expert_tokens_total" and ("layer", "1") in k[1]]


def test_expert_tokens_cross_the_stats_frame():
    stats = _stats("decode-0", "decode", ((0, (0, 3, 1)), (1, (2, 2, 0))))
    body = msgpack.unpackb(msgpack.packb(stats_to_wire(stats)))
    assert stats_from_wire(body).expert_tokens == stats.expert_tokens
    with pytest.raises(ValueError, match=r"WorkerStats.expert_tokens"):
        stats_from_wire({**body, "expert_tokens": [[0, [1.5]]]})


def test_pairs_per_rank_and_rebalances_are_exported_for_expert_parallel_workers():
    ep = WorkerStats(name="decode-0", role="decode", incarnation="i", ready=True, expert_tokens=((0, (4, 4)),),
                     expert_rank_tokens=((0, (6, 2)),), expert_rebalances=3)
    m = ClusterMetrics("nixl", MODEL, workers=_Workers(ep, _stats("prefill-0", "prefill", ((0, (1, 1)),))))
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}
    rank = {"model_name": MODEL, "worker": "decode-0", "role": "decode", "layer": "0"}
    assert samples["splitserve_expert_rank_tokens_total", frozenset({**rank, "rank": "0"}.items())] == 6
    assert samples["splitserve_expert_rank_tokens_total", frozenset({**rank, "rank": "1"}.items())] == 2
    assert samples["splitserve_expert_rebalances_total",
                   frozenset({"model_name": MODEL, "worker": "decode-0", "role": "decode"}.items())] == 3
    # a worker without expert parallelism has no rank series
    assert not [k for k in samples if k[0].startswith("splitserve_expert_rebalances") and ("worker", "prefill-0") in k[1]]
    body = msgpack.unpackb(msgpack.packb(stats_to_wire(ep)))
    assert stats_from_wire(body).expert_rank_tokens == ep.expert_rank_tokens
