"""`--frontends 2`: two gRPC frontend processes on one port (SO_REUSEPORT), sharing 1 prefill and 2
decode workers. Real Ray actors, real gRPC on 127.0.0.1, KV over TCP; one cluster for the module."""
from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster.launch.app import ClusterConfig
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from cluster_harness import ClusterThread
from proto.splitserve.v1 import inference_pb2 as pb
from router.client import Client

pytestmark = pytest.mark.ray


def _engine_config(model_dir):
    return EngineConfig(model=model_dir, dtype="float32", num_threads=1, cache=CacheConfig(block_size=4, num_blocks=256))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = ClusterThread(ClusterConfig(engine=_engine_config(tiny_model_dir("llama")),
                                    data_plane=DataPlaneConfig(transport="tcp"), port=0,
                                    num_prefill=1, num_decode=2, frontends=2,
                                    router=RouterConfig(local_prefill_max_tokens=4),
                                    max_tokens_limit=200, metrics_port=0, http_port=0))
    yield c
    c.stop()


def _served_by(cluster) -> list[float]:
    """Requests finished so far, per frontend (from each frontend's own series)."""
    out = []
    for families in ray.get([f.metric_samples.remote() for f in cluster.cluster.frontends]):
        fam = next(f for f in families if f.name == "splitserve_requests_finished")
        out.append(sum(s.value for s in fam.samples))
    return out


def _handoffs(cluster) -> dict[str, int]:
    return {s.name: s.handoff.done for s in cluster.stats() if s.role == "decode"}


def test_both_frontends_serve_the_same_tokens_as_one_engine(cluster, tiny_model_dir):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (9, 17, 30, 12, 25, 33, 7, 21)]
    ref = LLMEngine(_engine_config(tiny_model_dir("llama"))).generate(prompts, SamplingParams(max_tokens=12))
    outs = []
    for p in prompts * 2:            # a fresh channel per request: the kernel spreads them over both
        client = Client(cluster.target)
        outs.append(list(client.generate(p, max_tokens=12).token_ids))
        client.close()
    assert outs == [list(r.token_ids) for r in ref] * 2
    assert all(n > 0 for n in _served_by(cluster)), _served_by(cluster)
    assert all(s.blocks_used == 0 for s in cluster.wait_idle())


def test_the_http_api_is_served_by_both_frontends_on_one_port(cluster):
    import json
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (10, 19, 26)]
    client = Client(cluster.target)
    want = [list(client.generate(p, max_tokens=8).token_ids) for p in prompts]
    client.close()
    before = _served_by(cluster)
    got = []
    for p in prompts * 3:            # a connection per request: the kernel spreads them (SO_REUSEPORT)
        body = json.dumps({"prompt": p, "max_tokens": 8, "temperature": 0, "return_token_ids": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{cluster.cluster.http_port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got.append(json.loads(r.read())["choices"][0]["token_ids"])
    assert got == want * 3
    after = _served_by(cluster)
    assert sum(after) - sum(before) == 9
    assert all(s.blocks_used == 0 for s in cluster.wait_idle())


def test_shared_prefix_lands_on_one_decode_worker_whichever_frontend(cluster):
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, 384, (48,), generator=g).tolist()
    before, seen, landed = _handoffs(cluster), set(), set()
    for i in range(16):
        served, handoffs = _served_by(cluster), _handoffs(cluster)
        client = Client(cluster.target)
        client.generate(system + torch.randint(3, 384, (6,), generator=g).tolist(), max_tokens=3)
        client.close()
        seen |= {j for j, (a, b) in enumerate(zip(served, _served_by(cluster))) if b > a}
        landed |= {w for w, n in _handoffs(cluster).items() if n > handoffs[w]}
        if len(seen) == 2 and i >= 3:
            break
    assert seen == {0, 1}, "both frontends should have taken some of the requests"
    assert len(landed) == 1, f"one prefix, one decode worker; got {landed} (handoffs {before} -> {_handoffs(cluster)})"


def test_abort_reaches_the_owning_frontend_from_any(cluster):
    rid = "abort-me-across-frontends"
    owner = Client(cluster.target)
    got, done = [], threading.Event()

    def run():
        for msg in owner.stream(list(range(3, 40)), request_id=rid, max_tokens=190, ignore_eos=True):
            got.append(msg)
        done.set()
    t = threading.Thread(target=run)
    t.start()
    while not got:
        time.sleep(0.01)
    found = []
    for _ in range(6):                  # fresh channels: some land on the other frontend
        c = Client(cluster.target)
        found.append(c.stub.Abort(pb.AbortRequest(request_id=rid)).found)
        c.close()
        if done.wait(0.2):
            break
    t.join(30)
    assert found[0] is True
    assert got[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in got) < 190
    # Directly through each frontend's own Abort path: the non-owner passes it on.
    assert ray.get([f.abort_anywhere.remote("no-such-request") for f in cluster.cluster.frontends]) == [False, False]
    assert all(s.blocks_used == 0 and s.leases == 0 for s in cluster.wait_idle())


def test_one_scrape_covers_both_frontends(cluster):
    port = cluster.cluster.metrics_server[0].server_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    finished = sum(s.value for s in families["splitserve_requests_finished"].samples)
    assert finished == sum(_served_by(cluster)) > 0
    assert "splitserve_kv_cache_blocks_in_use" in families          # worker series still there
    ttft = next(s.value for s in families["splitserve_time_to_first_token_seconds"].samples
                if s.name.endswith("_count"))
    assert ttft >= finished - 1                                     # the aborted request may have none


def test_bad_frontend_count_is_refused(tiny_model_dir):
    from cluster.launch.app import start_cluster
    import asyncio
    with pytest.raises(ValueError, match="frontends must be >= 1"):
        asyncio.run(start_cluster(ClusterConfig(engine=_engine_config(tiny_model_dir("llama")), frontends=0)))
