"""Speculative decoding across the P/D handoff: real Ray, gRPC and NIXL on the default model.

Greedy output equals the single engine without speculation, and a handed-off request accepts as
many tokens per step as the same request served colocated, from its first decode step on."""
from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest

from cluster.launch.app import ClusterConfig, start_cluster
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig, default_model_file
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from cluster_harness import ClusterThread, session_ray
from router.client import Client

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
    "        self.values = {}\n\n    def load(self):\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.",
]
MAX_TOKENS = 48


def _engine_config(method="draft", model=None, tree_budget=0):
    # A fixed k: dynamic lookahead reacts to measured timings, so two runs may draft differently.
    # `model` None: the tests' default (stdlib-coder); "default": SmolLM2-135M-Instruct, whose
    # EAGLE head is the EAGLE-3-style one (three depths of features, fused, shipped fused), and
    # whose block drafter's window of features crosses the handoff in the KVHandle.
    # `tree_budget`: token trees (the head's runner-up leaves, every one verified: no minimum gain).
    extra = {} if model is None else {"model": default_model_file()}
    return EngineConfig(num_threads=1, cache=CacheConfig(num_blocks=512), **extra,
                        speculative=SpeculativeConfig(method=method, num_speculative_tokens=4,
                                                      spec_tree_budget=tree_budget, spec_tree_min_gain=0.0))


@functools.cache   # the default model's reference serves two cases
def _reference(model=None):
    engine = LLMEngine(replace(_engine_config(model=model), speculative=SpeculativeConfig()))
    return [list(c.token_ids) for c in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]


@pytest.fixture(scope="module")
def colocated():
    """Colocated clusters by engine config, started on first use and kept for the module: the
    draft case's also serves the validation test."""
    started: dict[str, ClusterThread] = {}
    lock = threading.Lock()

    def get(engine: EngineConfig) -> ClusterThread:
        with lock:
            if repr(engine) not in started:
                started[repr(engine)] = ClusterThread(ClusterConfig(http_port=None, engine=engine, colocated=True, port=0))
            return started[repr(engine)]
    yield get
    for c in started.values():
        c.stop()


def _scrape(cluster: ClusterThread) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    port = cluster.cluster.metrics_server[0].server_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, s.labels["method"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("splitserve_spec_") and s.labels.get("worker") == "decode-0"}


def _spec_totals(cluster: ClusterThread, method: str) -> tuple[int, int]:
    emitted = steps = 0
    for s in cluster.stats():
        c = s.spec_of(method)
        emitted += c.emitted
        steps += c.steps
    return emitted, steps


def _serve_one_by_one(cluster: ClusterThread, **sampling) -> tuple[list[list[int]], float]:
    """Requests one at a time, so both modes batch them alike; returns outputs and the mean
    accepted length per verification step over them."""
    client = Client(cluster.target)
    before = {m: _spec_totals(cluster, m) for m in ("draft", "ngram", "jacobi", "eagle", "block")}
    outs = [list(client.generate(p, max_tokens=MAX_TOKENS, **sampling).token_ids) for p in PROMPTS]
    method = sampling.get("speculative", "draft")
    cluster.wait_idle()
    emitted, steps = (a - b for a, b in zip(_spec_totals(cluster, method), before[method]))
    assert steps > 0, "no verification step ran: speculation silently fell back to plain decoding"
    return outs, emitted / steps


def _served_across_the_handoff(engine: EngineConfig, configured: str, methods, tree: int) -> dict:
    """Each method's outputs and mean accepted length through a 1P1D cluster, whose handoffs,
    blocks and Prometheus counters are checked on the way."""
    pd = ClusterThread(ClusterConfig(http_port=None, engine=engine, data_plane=DataPlaneConfig(transport="nixl"),
                                     port=0, router=RouterConfig(local_prefill_max_tokens=4), metrics_port=0))
    try:
        info = Client(pd.target).server_info()
        assert (info.speculative, info.num_speculative_tokens) == (configured, "4")
        # A salt per round: no prefix hits on the decode worker, so every request is handed off.
        results = {m: _serve_one_by_one(pd, speculative=m, cache_salt=m) for m in methods}
        stats = pd.wait_idle()
        assert all(s.blocks_used == 0 for s in stats), stats
        decode = next(s for s in stats if s.role == "decode")
        assert decode.handoff.done == len(methods) * len(PROMPTS) and decode.handoff.failed == 0
        want = {(f"splitserve_spec_{name}_total", method): getattr(decode.spec_of(method), key)
                for method in methods for name, key in (("draft_tokens", "drafted"), ("accepted_tokens", "accepted"),
                                                        ("verify_steps", "steps"), ("emitted_tokens", "emitted"))}
        assert all(v > 0 for v in want.values()), want
        if tree:   # leaves verified on the decode worker, their counters through to Prometheus
            want |= {(f"splitserve_spec_tree_{name}_tokens_total", m): getattr(decode.spec_of(m), key)
                     for m in methods for name, key in (("draft", "tree_drafted"), ("accepted", "tree_accepted"))}
            assert all(want[("splitserve_spec_tree_draft_tokens_total", m)] > 0 for m in methods), want
        # The router's copy of an idle worker's stats is at most one idle poll (2 s) behind: its
        # last push may predate the last step's counts (router/stats_poll.py StatsCadence).
        deadline = time.monotonic() + 10
        while (scraped := {k: _scrape(pd).get(k) for k in want}) != want and time.monotonic() < deadline:
            time.sleep(0.25)
        assert scraped == want
        return results
    finally:
        pd.stop()


def _served_colocated(colo: ClusterThread, methods) -> dict:
    return {m: _serve_one_by_one(colo, speculative=m, cache_salt=m) for m in methods}


@pytest.mark.parametrize("configured,methods,model,tree", [("draft", ("draft", "ngram", "jacobi"), None, 0),
                                                           ("eagle", ("eagle",), None, 4),
                                                           ("eagle", ("eagle",), "default", 0),
                                                           ("block", ("block",), "default", 0)],
                         ids=["draft-ngram-jacobi", "eagle-trees", "eagle3-default-model", "block-default-model"])
def test_speculation_across_the_handoff_matches_colocated(colocated, configured, methods, model, tree):
    """The P/D and the colocated cluster run side by side (each serves its requests one at a time,
    so what either accepts does not depend on the other), the single engine's reference beside them."""
    engine = _engine_config(configured, model, tree)
    session_ray()   # before the threads: none may start its own
    with ThreadPoolExecutor(3) as pool:
        reference_run = pool.submit(_reference, model)
        pd_run = pool.submit(_served_across_the_handoff, engine, configured, methods, tree)
        colocated_run = pool.submit(lambda: _served_colocated(colocated(engine), methods))
        reference, results, co_results = reference_run.result(), pd_run.result(), colocated_run.result()
    for method in methods:
        (pd_out, pd_len), (co_out, co_len) = results[method], co_results[method]
        assert pd_out == reference and co_out == reference, method
        assert pd_len > 1.0, f"{method}: mean accepted length {pd_len:.3f} <= 1"
        assert abs(pd_len - co_len) <= 0.02 * co_len, f"{method}: P/D {pd_len:.3f} vs colocated {co_len:.3f}"


def test_per_request_speculation_is_validated(colocated):
    """A method the server was not started with (it runs draft, n-gram and Jacobi) and more
    speculative tokens than it allows are refused, naming the field; "off" is plain decoding."""
    c = colocated(_engine_config("draft"))
    client = Client(c.target)
    for kwargs, field in (({"speculative": "eagle"}, "sampling.speculative"),
                          ({"num_speculative_tokens": 99}, "sampling.num_speculative_tokens")):
        with pytest.raises(grpc.RpcError) as err:
            client.generate("def f():", max_tokens=4, **kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
    out = client.generate("def f():", max_tokens=4, speculative="off")
    assert len(out.token_ids) == 4
    c.wait_idle()


def test_eagle_head_of_another_shape_is_refused_before_anything_starts(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"model_type": "splitserve_eagle", "hidden_size": 384,
                                                  "vocab_size": 8192, "num_key_value_heads": 6, "head_dim": 64}))
    cfg = ClusterConfig(http_port=None, engine=EngineConfig(speculative=SpeculativeConfig(method="eagle", eagle_head=head)), port=0)
    with pytest.raises(ValueError, match="KV shape .* across the P/D handoff"):
        asyncio.run(start_cluster(cfg))
