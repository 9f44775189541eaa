"""Faults on the real cluster (Ray, gRPC on 127.0.0.1, NIXL), one 1 prefill + 2 decode cluster
shared by the module, float32 so that every surviving request's tokens can be compared with a
single engine's: readiness, request errors that are not worker errors, KV pressure with handed-off
requests, and workers killed with SIGKILL during prefill, handoff and decode (restarted by Ray as
new incarnations that rejoin). Every test ends with every pool empty."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.launch.app import ClusterConfig
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig
from cluster.types import SamplingParams
from cluster_harness import ClusterThread, session_ray
from router.client import Client
from helpers import free_port

pytestmark = pytest.mark.ray

BLOCKS = 48          # per worker, 4 tokens each: a few long requests fill a decode worker
SEEDED = dict(temperature=0.9, top_p=0.95, seed=123)


def _engine_config(model_dir, num_blocks=BLOCKS):
    return EngineConfig(model=model_dir, dtype="float32", num_threads=1,
                        cache=CacheConfig(block_size=4, num_blocks=num_blocks))


def _prompts(n, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, single_engine):
    engine = single_engine(_engine_config(tiny_model_dir("llama"), num_blocks=1024))

    def run(prompts, **sampling):
        return [list(o.token_ids) for o in engine.generate(prompts, SamplingParams(**sampling))]
    return run


class _Started:
    """The module's cluster, and what was seen while it started."""

    def __init__(self, model_dir):
        self.port = free_port()
        self.health_seen: list[int] = []
        self.early: list = []
        cfg = ClusterConfig(http_port=None, engine=_engine_config(model_dir), data_plane=DataPlaneConfig(transport="nixl"),
                            port=self.port, num_prefill=1,
                            num_decode=2, router=RouterConfig(local_prefill_max_tokens=4), max_tokens_limit=200)
        box: dict = {}
        session_ray()       # here, not in the starter thread: Ray's processes die with the thread that starts them
        starter = threading.Thread(target=lambda: box.setdefault("c", ClusterThread(cfg)), daemon=True)
        starter.start()
        target = f"127.0.0.1:{self.port}"
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        early = None
        limit = time.monotonic() + 180
        while starter.is_alive() and time.monotonic() < limit:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Inference"), timeout=2).status
            except grpc.RpcError:
                time.sleep(0.05)
                continue
            self.health_seen.append(status)
            if status == health_pb2.HealthCheckResponse.NOT_SERVING and early is None:
                # Sent while the workers load: it must wait for readiness, not fail.
                early = ThreadPoolExecutor(1).submit(lambda: Client(target).generate(EARLY_PROMPT, max_tokens=8,
                                                                                     timeout=120))
            time.sleep(0.05)
        starter.join(180)
        self.c = box["c"]
        self.early_result = early.result(120) if early is not None else None
        self.health_seen.append(stub.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Inference")).status)


EARLY_PROMPT = list(range(10, 40))


@pytest.fixture(scope="module")
def started(tiny_model_dir):
    s = _Started(tiny_model_dir("llama"))
    yield s
    s.c.stop()


@pytest.fixture
def cluster(started):
    """The cluster, every worker routable at the start of the test and every pool empty at its end."""
    _wait_routable(started.c)
    yield started.c
    started.c.wait_idle(timeout=30)


def _wait_routable(c: ClusterThread, timeout=90.0) -> None:
    limit = time.monotonic() + timeout
    while not all(v.healthy for v in c.cluster.router.views.values()):
        assert time.monotonic() < limit, {n: h.state for n, h in c.cluster.router.health.items()}
        time.sleep(0.1)


def _kill(c: ClusterThread, name: str) -> int:
    pid = next(s.pid for s in c.stats() if s.name == name)
    os.kill(pid, signal.SIGKILL)
    return pid


def _concurrent(target, prompts, **sampling):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: Client(target).generate(p, timeout=120, **sampling), prompts))


def test_health_is_not_serving_until_every_worker_is_ready_and_early_requests_wait(started, reference):
    seen = started.health_seen
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, seen
    assert seen[-1] == health_pb2.HealthCheckResponse.SERVING
    assert started.early_result is not None, "the server never said NOT_SERVING while its workers loaded"
    assert list(started.early_result.token_ids) == reference([EARLY_PROMPT], max_tokens=8)[0]


def test_a_prompt_no_worker_can_hold_is_the_requests_error_not_the_workers(cluster):
    client = Client(cluster.target)
    with pytest.raises(grpc.RpcError) as info:
        client.generate(list(range(3, 3 + 4 * BLOCKS)), max_tokens=4)     # 193 tokens with the first: 49 blocks
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "need 49 KV blocks" in info.value.details() and "holds 48" in info.value.details()
    assert all(v.healthy for v in cluster.cluster.router.views.values())
    assert len(client.generate([5, 6, 7, 8, 9, 10], max_tokens=3).token_ids) == 3


def test_kv_pressure_with_handed_off_requests_loses_and_cuts_nothing(cluster, reference):
    """Twelve long requests at once on two decode workers of 48 blocks: each needs up to 25, so
    handoffs are declined (the producer's pins released at once) or wait, and running requests are
    preempted; every request ends with the single engine's tokens and its full length."""
    prompts = _prompts(12, [40, 52, 60, 47], seed=21)
    outs = _concurrent(cluster.target, prompts, max_tokens=40, ignore_eos=True)
    assert [list(o.token_ids) for o in outs] == reference(prompts, max_tokens=40, ignore_eos=True)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in outs)
    assert all(v.healthy for v in cluster.cluster.router.views.values())


def test_prefill_worker_killed_during_prefill_and_handoff(cluster, reference):
    prompts = _prompts(8, [90, 120, 100, 110], seed=31)
    client = Client(cluster.target)
    with ThreadPoolExecutor(len(prompts)) as pool:
        calls = [pool.submit(lambda p=p: Client(cluster.target).generate(p, timeout=120, max_tokens=12, ignore_eos=True))
                 for p in prompts]
        time.sleep(0.05)                 # some requests are in prefill, some handing off
        _kill(cluster, "prefill-0")
        outs = [f.result(150) for f in calls]
    assert [list(o.token_ids) for o in outs] == reference(prompts, max_tokens=12, ignore_eos=True)
    _wait_routable(cluster)
    assert client.generate(prompts[0], max_tokens=12, ignore_eos=True).token_ids == outs[0].token_ids


def test_decode_worker_killed_during_pulls(cluster, reference):
    prompts = _prompts(8, [30, 44, 36, 50], seed=41)
    target = cluster.target
    first = threading.Event()

    def run(p):
        got = []
        for msg in Client(target).stream(p, timeout=120, max_tokens=24, ignore_eos=True):
            got.extend(msg.token_ids)
            first.set()                  # a first token is out: its handoff is starting
        return got
    with ThreadPoolExecutor(len(prompts)) as pool:
        calls = [pool.submit(run, p) for p in prompts]
        assert first.wait(60)
        _kill(cluster, "decode-0")
        outs = [f.result(150) for f in calls]
    assert outs == reference(prompts, max_tokens=24, ignore_eos=True)


def test_seeded_request_continued_on_another_worker_resumes_its_generator(cluster, reference):
    prompt = _prompts(1, [20], seed=51)[0]
    ref = reference([prompt], max_tokens=150, ignore_eos=True, **SEEDED)[0]     # 170 tokens: fits 48 blocks
    tokens, killed = [], None
    before = cluster.cluster.router.recoveries
    for msg in Client(cluster.target).stream(prompt, timeout=120, max_tokens=150, ignore_eos=True, **SEEDED):
        tokens.extend(msg.token_ids)
        # The second token comes from the decode worker: kill it as early as that, so that the
        # request cannot have ended first however slowly this client reads.
        if killed is None and len(tokens) >= 2:
            busy = [n for n, v in cluster.cluster.router.views.items() if v.role == "decode" and v.in_flight]
            killed = busy[0]
            _kill(cluster, killed)
    assert killed is not None and cluster.cluster.router.recoveries > before
    assert tokens == ref                   # the same draws as one engine: none lost, none repeated


def test_a_restarted_worker_rejoins_as_a_new_incarnation_and_takes_work(cluster, reference):
    router = cluster.cluster.router
    old = router.health["decode-1"].incarnation
    _kill(cluster, "decode-1")
    limit = time.monotonic() + 90
    while router.health["decode-1"].incarnation == old or not router.views["decode-1"].healthy:
        assert time.monotonic() < limit, router.health["decode-1"]
        time.sleep(0.1)
    before = {s.name: s.handoff.done + s.queue_count for s in cluster.stats() if s.role == "decode"}
    prompts = _prompts(16, [12, 20, 28, 16], seed=61)
    outs = _concurrent(cluster.target, prompts, max_tokens=6, ignore_eos=True)
    assert [list(o.token_ids) for o in outs] == reference(prompts, max_tokens=6, ignore_eos=True)
    after = {s.name: s.handoff.done + s.queue_count for s in cluster.wait_idle() if s.role == "decode"}
    assert after["decode-1"] > before["decode-1"], (before, after)
