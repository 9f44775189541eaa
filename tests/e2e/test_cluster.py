"""The disaggregated cluster as users meet it: real Ray actors, real gRPC on 127.0.0.1, real NIXL."""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from cluster.launch.app import ClusterConfig
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig
from cluster.types import KVCompaction, SamplingParams
from cluster_harness import ClusterThread
from tiny_models import long_context_copy
from proto.splitserve.v1 import inference_pb2 as pb
from router.client import Client

pytestmark = pytest.mark.ray

MAX_TOKENS = 16


def _engine_config(model_dir):
    return EngineConfig(model=model_dir, dtype="float32", num_threads=1, cache=CacheConfig(block_size=4, num_blocks=256))


def _prompts(n=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 17, 30, 45, 60, 12, 25, 33, 7, 51, 19, 40, 4, 28, 36]
    return [torch.randint(3, 384, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, single_engine):
    engine = single_engine(_engine_config(tiny_model_dir("llama")))

    def run(prompts, sampling):
        return [list(o.token_ids) for o in engine.generate(prompts, sampling)]
    return run


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = ClusterThread(ClusterConfig(http_port=None, engine=_engine_config(tiny_model_dir("llama")),
                                    data_plane=DataPlaneConfig(transport="nixl"), port=0,
                                    router=RouterConfig(local_prefill_max_tokens=4), max_tokens_limit=64,
                                    metrics_port=0))
    yield c
    c.stop()


def _concurrent(client, prompts, **sampling):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.generate(p, **sampling), prompts))


def test_16_concurrent_greedy_requests_equal_single_engine(cluster, reference):
    client = Client(cluster.target)
    prompts = _prompts()
    outs = _concurrent(client, prompts, max_tokens=MAX_TOKENS)
    assert [list(o.token_ids) for o in outs] == reference(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    stats = cluster.wait_idle()
    assert all(s.blocks_used == 0 for s in stats), stats
    decode = next(s for s in stats if s.role == "decode")
    assert decode.handoff.done >= 14 and decode.handoff.failed == 0   # 2 prompts are short: local


def test_seeded_sampling_reproduces_single_engine(cluster, reference):
    client = Client(cluster.target)
    prompts = _prompts(4)
    outs = _concurrent(client, prompts, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=77)
    ref = reference(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=77))
    assert [list(o.token_ids) for o in outs] == ref
    cluster.wait_idle()


def test_text_prompt_and_server_info(cluster, tiny_model_dir):
    client = Client(cluster.target)
    out = client.generate("def add(a, b):", max_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    info = client.server_info()
    assert info.mode == "disaggregated" and info.prefill_workers == 1 and info.kv_transport == "nixl"
    models = client.stub.ListModels(pb.ListModelsRequest())
    assert models.models[0].id == tiny_model_dir("llama").name and models.models[0].vocab_size == 384
    assert models.models[0].max_model_len == 256


@pytest.mark.parametrize("request_kwargs, code, text", [
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "prompt: set either text or token_ids"),
    ({"token_ids": pb.TokenIds(ids=[1, 999])}, grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids"),
    ({"token_ids": pb.TokenIds(ids=list(range(3, 260)))}, grpc.StatusCode.INVALID_ARGUMENT,
     "has 257 tokens but the model's context is 256"),
    ({"text": "x", "sampling": pb.SamplingParams(max_tokens=65)}, grpc.StatusCode.INVALID_ARGUMENT, "limit of 64"),
    ({"text": "x", "sampling": pb.SamplingParams(temperature=-2)}, grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.temperature"),
    ({"text": "x", "model": "nope"}, grpc.StatusCode.INVALID_ARGUMENT, "model"),
])
def test_bad_input_gets_invalid_argument(cluster, request_kwargs, code, text):
    client = Client(cluster.target)
    with pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(pb.GenerateRequest(**request_kwargs)))
    assert info.value.code() == code
    assert text in info.value.details()
    cluster.wait_idle()


def test_oversized_message_is_refused(cluster):
    client = Client(cluster.target)
    with pytest.raises(grpc.RpcError) as info:
        client.generate("x" * (5 << 20), max_tokens=1)       # over the server's 4 MiB message limit
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    cluster.wait_idle()


def test_cancel_mid_stream_frees_every_block(cluster):
    client = Client(cluster.target)
    call = client.stream(_prompts(1)[0] * 2, max_tokens=64, ignore_eos=True)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 3:
            call.cancel()
            break
    stats = cluster.wait_idle()
    assert all(s.blocks_used == 0 and s.leases == 0 for s in stats), stats


def test_deadline_exceeded_stops_the_request(cluster):
    client = Client(cluster.target)
    # A 9-token prompt goes through a prefill worker (local_prefill_max_tokens=4), and 10 ms is less
    # than that handoff alone takes here (~11 ms): the request cannot finish first however fast the
    # engine decodes (with a 50 ms deadline the tiny model's 64 tokens sometimes did).
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(_prompts(2)[1], max_tokens=64, ignore_eos=True, timeout=0.01))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = cluster.wait_idle()
    assert all(s.blocks_used == 0 for s in stats), stats


def test_overload_answers_resource_exhausted(cluster):
    admission = cluster.cluster.frontend.service.admission
    old = admission.cfg
    # One slot, held by another tenant, and no queue: the request is refused at once. (An
    # AdmissionConfig of 0 slots is refused by its own check.)
    admission.cfg = dataclasses.replace(old, max_in_flight=1, max_queued=0)
    held = cluster.run(admission.acquire("another tenant", 1))
    try:
        with pytest.raises(grpc.RpcError) as info:
            Client(cluster.target).generate("x", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        async def give_back():
            admission.release(held)
        cluster.run(give_back())
        admission.cfg = old


def test_api_key_required_when_configured(cluster):
    svc = cluster.cluster.service
    from cluster.secrets import as_api_keys
    svc.api_keys = as_api_keys(("sekrit",))
    try:
        with pytest.raises(grpc.RpcError) as info:
            Client(cluster.target).generate("x", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert Client(cluster.target, api_key="sekrit").generate("x", max_tokens=2).finish_reason == "length"
        with pytest.raises(grpc.RpcError):
            Client(cluster.target, api_key="wrong").generate("x", max_tokens=2)
    finally:
        svc.api_keys = ()


def test_health_service_reports_serving(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(cluster.target))
    resp = stub.Check(health_pb2.HealthCheckRequest(service="splitserve.v1.Inference"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_two_prefill_two_decode_workers(tiny_model_dir, reference):
    c = ClusterThread(ClusterConfig(http_port=None, engine=_engine_config(tiny_model_dir("llama")),
                                    data_plane=DataPlaneConfig(transport="nixl"), port=0,
                                    num_prefill=2, num_decode=2, router=RouterConfig(local_prefill_max_tokens=4),
                                    policy="least_loaded"))
    try:
        client = Client(c.target)
        prompts = _prompts()
        outs = _concurrent(client, prompts, max_tokens=MAX_TOKENS)
        assert [list(o.token_ids) for o in outs] == reference(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        stats = c.wait_idle()
        assert all(s.blocks_used == 0 for s in stats)
        used = [s for s in stats if s.role == "decode" and s.handoff.done > 0]
        assert len(used) == 2, "both decode workers should have taken handoffs"
    finally:
        c.stop()


def _scrape(cluster) -> dict[str, float]:
    """Every sample but buckets, by `name{label=value,...}`; each must carry the served model's name
    (`model_name`, left out of the key)."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    port = cluster.cluster.metrics_server[0].server_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    model = cluster.cluster.frontend.service.limits.model_id
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == model, sample
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("le", "model_name"))
            if "le" in sample.labels:
                continue
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_metrics_count_what_was_sent(cluster):
    # The baseline after a stats poll of the idle cluster (polls come at most 2 s apart when idle):
    # a scrape right after an earlier test's requests can miss its last handoff, counted in `after`.
    cluster.wait_idle()
    time.sleep(2.5)
    before = _scrape(cluster)
    client = Client(cluster.target)
    prompts = _prompts(6, seed=99)                    # unseen prompts: no local prefill for cache hits
    outs = _concurrent(client, prompts, max_tokens=5, ignore_eos=True)
    cluster.wait_idle()
    # The workers' last stats of the requests: a prefill worker's leases end without a step (so
    # without a push), and the driver's Ray poll reads them within 0.75 s (router/stats_poll.py).
    time.sleep(1.0)
    after = _scrape(cluster)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)
    assert delta("splitserve_requests_finished_total{reason=length,tenant=anonymous}") == 6
    assert delta("splitserve_time_to_first_token_seconds_count{}") == 6
    assert delta("splitserve_generation_tokens_total{tenant=anonymous}") == sum(len(o.token_ids) for o in outs) == 30
    assert delta("splitserve_inter_token_latency_seconds_count{}") == 24
    # The first prompt has 3 tokens (<= --local-prefill-max-tokens 4): prefilled on the decode worker.
    assert delta("splitserve_prefills_total{place=short}") == 1
    assert delta("splitserve_prefills_total{place=handoff}") == 5
    assert delta("splitserve_kv_transfers_total{transport=nixl,worker=decode-0}") == 5
    assert delta("splitserve_kv_transfer_bytes_total{transport=nixl,worker=decode-0}") > 0
    assert after["splitserve_kv_cache_blocks_in_use{role=decode,worker=decode-0}"] == 0
    assert after["splitserve_kv_cache_blocks_in_use{role=prefill,worker=prefill-0}"] == 0
    assert "splitserve_prefix_cache_hits_total{role=prefill,worker=prefill-0}" in after
    assert delta("splitserve_request_decode_time_seconds_count{}") == 6
    assert delta("splitserve_request_queue_time_seconds_count{role=prefill,worker=prefill-0}") == 5
    assert delta("splitserve_request_prompt_tokens_count{}") == 6
    assert delta("splitserve_request_generation_tokens_count{}") == 6
    assert delta("splitserve_request_generation_tokens_sum{}") == 30
    assert after["splitserve_kv_cache_usage_ratio{role=decode,worker=decode-0}"] == 0
    assert "splitserve_num_preemptions_total{role=decode,worker=decode-0}" in after
    # Both workers stepped for these requests: each pushed its stats over its token stream at least
    # once (the decode worker to the stream its tokens take, the prefill worker to the caller's).
    assert delta("splitserve_worker_stats_reports_total{source=push,worker=decode-0}") >= 1
    assert delta("splitserve_worker_stats_reports_total{source=push,worker=prefill-0}") >= 1


def test_a_handed_off_request_costs_the_router_one_ray_call(cluster, reference):
    """1P1D: the router calls the prefill worker once, naming the decode worker; the prefill worker
    streams the first token and starts the decode itself. Streamed or not, one call."""
    router = cluster.cluster.router
    client = Client(cluster.target)
    prompts = [p for p in _prompts(8, seed=7) if len(p) > 4][:2]     # unseen, over --local-prefill-max-tokens
    cluster.wait_idle()
    before = router.worker_calls
    out = client.generate(prompts[0], max_tokens=6, ignore_eos=True)
    assert router.worker_calls - before == 1
    streamed = [t for msg in client.stream(prompts[1], max_tokens=6, ignore_eos=True) for t in msg.token_ids]
    assert router.worker_calls - before == 2
    assert [list(out.token_ids), streamed] == reference(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    cluster.wait_idle()
    assert router.worker_calls - before == 2        # nothing was left to abort


@pytest.fixture(scope="module")
def colocated_tls(tiny_model_dir, tmp_path_factory):
    """One colocated cluster serving gRPC over TLS (a self-signed certificate for 127.0.0.1), for
    the colocated API and the TLS tests alike."""
    import subprocess
    tmp = tmp_path_factory.mktemp("tls")
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    c = ClusterThread(ClusterConfig(http_port=None, engine=_engine_config(tiny_model_dir("llama")), colocated=True, port=0,
                                    tls=(key.read_bytes(), cert.read_bytes())))
    c.credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    yield c
    c.stop()


def test_colocated_mode_serves_the_same_api(colocated_tls, reference):
    c = colocated_tls
    client = Client(c.target, credentials=c.credentials)
    assert client.server_info().mode == "colocated"
    prompts = _prompts(8, seed=5)
    outs = _concurrent(client, prompts, max_tokens=MAX_TOKENS)
    assert [list(o.token_ids) for o in outs] == reference(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert all(s.blocks_used == 0 for s in c.wait_idle())


def test_decode_worker_killed_mid_stream_loses_no_token(tiny_model_dir, tmp_path, single_engine):
    import ray
    # 3,000 tokens to go when the kill is sent: the request cannot end before the worker dies.
    engine = dataclasses.replace(_engine_config(long_context_copy(tiny_model_dir("llama"), tmp_path / "model")),
                     cache=CacheConfig(block_size=4, num_blocks=1024))
    prompt = _prompts(1, seed=8)[0]
    ref = list(single_engine(engine).generate([prompt], SamplingParams(max_tokens=3000, ignore_eos=True))[0].token_ids)
    c = ClusterThread(ClusterConfig(http_port=None, engine=engine, data_plane=DataPlaneConfig(transport="nixl"), port=0,
                                    num_prefill=1, num_decode=2, router=RouterConfig(local_prefill_max_tokens=4),
                                    max_tokens_limit=3000))
    try:
        client = Client(c.target)
        tokens, killed = [], None
        for msg in client.stream(prompt, max_tokens=3000, ignore_eos=True):
            tokens.extend(msg.token_ids)
            if killed is None and len(tokens) >= 5:
                busy = [n for n, v in c.cluster.router.views.items() if v.role == "decode" and v.in_flight]
                killed = busy[0]
                ray.kill(c.cluster.workers[killed].handle, no_restart=False)
        assert killed is not None
        assert c.cluster.router.recoveries == 1                # the stream really moved to the other worker
        assert tokens == ref                                   # nothing lost, nothing repeated
        # The killed worker is restarted by Ray, reconnected, and takes handoffs again.
        limit = time.monotonic() + 180   # a new worker process loads torch and the model: minutes on a loaded machine
        while not c.cluster.router.views[killed].healthy and time.monotonic() < limit:
            time.sleep(0.2)
        assert c.cluster.router.views[killed].healthy
        outs = _concurrent(client, _prompts(8, seed=9), max_tokens=4)
        assert all(o.finish_reason in ("length", "stop") for o in outs)
        stats = c.wait_idle()
        assert all(s.blocks_used == 0 for s in stats), stats
    finally:
        c.stop()


def test_tls_serving(colocated_tls):
    c = colocated_tls
    out = Client(c.target, credentials=c.credentials).generate("def add(a, b):", max_tokens=3)
    assert len(out.token_ids) == 3
    with pytest.raises(grpc.RpcError):                  # plaintext is refused
        Client(c.target).generate("x", max_tokens=1, timeout=5)
    c.wait_idle()


def test_every_worker_runs_the_one_kernel_plan_on_its_own_cores(cluster):
    """The driver resolves the plan once and hands it to every worker: a prefill and a decode
    worker never compute the same rows with different kernels. Local workers get threads and
    (where the node has cores to spare) disjoint pinned cores."""
    async def go():
        return [await c.handle.compute_setup.remote() for c in cluster.cluster.workers.values()]
    setups = cluster.run(go())
    assert len(setups) == 2 and setups[0].plan == setups[1].plan
    assert all(s.threads == 1 for s in setups)
    pinned = [set(s.cpus) for s in setups if s.cpus is not None]
    assert all(not (a & b) for i, a in enumerate(pinned) for b in pinned[i + 1:])


def test_windowed_request_through_the_handoff_equals_one_engine(cluster, reference):
    """Attention sinks with a window per request (docs/kv_compress.md): a prompt within its window
    is handed off and decodes past it on the decode worker as one engine would; a prompt past its
    window is refused by name (only the live blocks would have to move: not built yet)."""
    client = Client(cluster.target)
    fresh = _prompts(4, seed=4242)[3]   # in no other test: no cached prefix routes it around the handoff
    prompt = fresh[:19]   # within its window; its first decode on the decode worker drops a block
    window = dict(kv_window=12, kv_sink_tokens=3)
    handed = next(s for s in cluster.wait_idle() if s.role == "decode").handoff.done
    out = client.generate(prompt, max_tokens=40, ignore_eos=True, **window)
    assert list(out.token_ids) == reference([prompt], SamplingParams(max_tokens=40, ignore_eos=True, **window))[0]
    with pytest.raises(grpc.RpcError) as err:
        client.generate(fresh[::-1], max_tokens=4, **window)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "P/D handoff" in err.value.details()
    stats = cluster.wait_idle()
    assert all(s.blocks_used == 0 and s.leases == 0 for s in stats), stats
    assert next(s for s in stats if s.role == "decode").handoff.done == handed + 1


def test_compacted_request_through_the_handoff_equals_one_engine(cluster, reference, single_engine, tiny_model_dir):
    """KV compaction per request (docs/kv_compress.md) through the served P/D cluster (gRPC, NIXL):
    the prefill worker compacts its 30-token prompt to 7 entries, the handoff moves their 2 blocks
    (not the prompt's 8) and the decode worker's tokens equal one engine compacting the same
    request; a bad kv_compaction is INVALID_ARGUMENT naming the field."""
    client = Client(cluster.target)
    prompt = _prompts(4, seed=4343)[3]
    assert len(prompt) == 30
    spec = KVCompaction(ratio=4, recent=4, observe=6, sinks=1)
    per_block = single_engine(_engine_config(tiny_model_dir("llama"))).layout.bytes_per_block()
    before = next(s for s in cluster.wait_idle() if s.role == "decode").handoff
    out = client.generate(prompt, max_tokens=20, ignore_eos=True,
                          kv_compaction=pb.KVCompaction(ratio=4, recent=4, observe=6, sinks=1))
    assert list(out.token_ids) == reference([prompt], SamplingParams(max_tokens=20, ignore_eos=True,
                                                                     kv_compaction=spec))[0]
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt, max_tokens=4, kv_compaction=pb.KVCompaction(ratio=0.5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_compaction.ratio" in err.value.details()
    stats = cluster.wait_idle()
    assert all(s.blocks_used == 0 and s.leases == 0 for s in stats), stats
    after = next(s for s in stats if s.role == "decode").handoff
    assert (after.done - before.done, after.bytes - before.bytes) == (1, 2 * per_block)
