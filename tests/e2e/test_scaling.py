"""Admin operations on a running cluster under load (one 1 prefill + 2 decode cluster with
switchable workers, shared by the module, float32 so that every stream can be compared with a
single engine's greedy output): a decode worker switched to prefill and back, and the decode pool
scaled 2 -> 1, each while greedy streams run; every stream equals the undisturbed output, the
drained sequences' KV moved to the other decode worker (counted), and every pool is idle after.
Decode workers are also removed by SIGTERM and added by `Scale`."""
from __future__ import annotations

import io
import itertools
import os
import signal
import threading
import time
from contextlib import redirect_stdout

import pytest
import torch
from cluster_harness import ClusterThread
from helpers import free_port
from tiny_models import long_context_copy

from cluster.config import CacheConfig, EngineConfig
from cluster.launch.app import ClusterConfig
from cluster.launch.cli import main as cli_main
from cluster.launch.planner_live import AdminActuator, LivePlanner, LiveSnapshots
from cluster.planner.costs import DEFAULT_PROFILE, load_profile
from cluster.planner.loop import apply
from cluster.planner.planner_config import PlannerConfig
from cluster.planner.snapshot import ActionKind
from cluster.types import SamplingParams
from proto.splitserve.v1 import inference_pb2 as pb
from router.client import Client
from router.router import RouterConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STREAMS, MAX_TOKENS = 12, 400


def _engine_config(model_dir, num_blocks=1024):
    return EngineConfig(model=model_dir, dtype="float32", num_threads=1,
                        cache=CacheConfig(block_size=4, num_blocks=num_blocks))


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (12 + 3 * i,), generator=g).tolist() for i in range(STREAMS)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The default tiny model with room for streams that outlast an action (same weights, same tokens)."""
    return long_context_copy(tiny_model_dir("llama"), tmp_path_factory.mktemp("scaling") / "llama")


@pytest.fixture(scope="module")
def reference(model_dir, single_engine):
    engine = single_engine(_engine_config(model_dir, num_blocks=2048))

    def run(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [list(o.token_ids) for o in engine.generate(prompts, params)]
    return run


@pytest.fixture(scope="module")
def cluster(model_dir):
    cfg = ClusterConfig(http_port=None, engine=_engine_config(model_dir), port=free_port(),
                        num_prefill=1, num_decode=2, router=RouterConfig(local_prefill_max_tokens=4),
                        switchable_roles=True, drain_timeout_s=60.0)
    c = ClusterThread(cfg)
    yield c
    c.stop()


class _Load:
    """Greedy streams in flight, each one's tokens as the client received them."""

    def __init__(self, target: str, prompts: list[list[int]]):
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.arrivals: list[list[float]] = [[] for _ in prompts]
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(target, i, p), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, target: str, i: int, prompt: list[int]) -> None:
        try:
            for msg in Client(target).stream(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                             timeout=300):
                self.tokens[i].extend(msg.token_ids)
                self.arrivals[i].append(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def wait_started(self, at_least: int = 4, timeout: float = 120.0) -> None:
        limit = time.monotonic() + timeout
        while any(len(t) < at_least for t in self.tokens) and time.monotonic() < limit and not self.errors:
            time.sleep(0.02)
        assert not self.errors, self.errors
        assert all(0 < len(t) < MAX_TOKENS for t in self.tokens), [len(t) for t in self.tokens]

    def longest_gap(self) -> float:
        """The longest wait between two messages of one stream (a moved sequence's time to resume)."""
        return max(b - a for times in self.arrivals for a, b in itertools.pairwise(times))

    def finish(self) -> list[list[int]]:
        for t in self.threads:
            t.join(300)
        assert not self.errors, self.errors
        return self.tokens


def _drained(cluster, outcome: str) -> float:
    metrics = cluster.cluster.metrics
    value = metrics.registry.get_sample_value("splitserve_drained_sequences_total",
                                              {"model_name": metrics.model_name, "outcome": outcome})
    return value or 0.0


def _roles(cluster) -> dict[str, str]:
    info = Client(cluster.target).stub.ServerInfo(pb.ServerInfoRequest())
    return {w.name: w.role for w in info.workers}


def _under_load(cluster, reference, seed: int, action) -> None:
    prompts = _prompts(seed)
    load = _Load(cluster.target, prompts)
    load.wait_started()
    t0 = time.monotonic()
    action()
    took = time.monotonic() - t0
    assert load.finish() == reference(prompts)
    cluster.wait_idle(timeout=30)
    print(f"\n[scaling] action {took:.2f}s, longest gap in a stream {load.longest_gap():.3f}s, drained so far: "
          f"moved {_drained(cluster, 'moved'):.0f}, recomputed {_drained(cluster, 'recomputed'):.0f}")


def test_switch_roles_under_load(cluster, reference):
    before = _drained(cluster, "moved")
    client = Client(cluster.target)
    _under_load(cluster, reference, 1, lambda: client.admin("SwitchRole", pb.SwitchRoleRequest(worker="decode-1",
                                                                                             to="prefill")))
    assert _roles(cluster) == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "prefill"}
    assert _drained(cluster, "moved") > before     # decode-1's sequences went on on decode-0, their KV moved
    _under_load(cluster, reference, 2, lambda: client.admin("SwitchRole", pb.SwitchRoleRequest(worker="decode-1",
                                                                                             to="decode")))
    assert _roles(cluster) == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}


def test_sigterm_drains_a_decode_worker_under_load(cluster, reference):
    before = _drained(cluster, "moved")
    pid = cluster.run(cluster.cluster.workers["decode-1"].stats()).pid
    _under_load(cluster, reference, 4, lambda: os.kill(pid, signal.SIGTERM))
    limit = time.monotonic() + 60
    while "decode-1" in _roles(cluster) and time.monotonic() < limit:
        time.sleep(0.1)
    assert _roles(cluster) == {"prefill-0": "prefill", "decode-0": "decode"}     # a drain is a removal
    assert _drained(cluster, "moved") > before


def test_scale_decode_up_then_down_under_load(cluster, reference):
    added = Client(cluster.target).admin("Scale", pb.ScaleRequest(decode=2))
    assert list(added.actions) == ["add decode-2 (decode)"]
    assert _roles(cluster) == {"prefill-0": "prefill", "decode-0": "decode", "decode-2": "decode"}
    before = _drained(cluster, "moved")
    reply = {}
    _under_load(cluster, reference, 3, lambda: reply.setdefault(
        "r", Client(cluster.target).admin("Scale", pb.ScaleRequest(decode=1))))
    assert list(reply["r"].actions) and all(a.startswith("remove decode-") for a in reply["r"].actions)
    roles = _roles(cluster)
    assert sorted(roles.values()) == ["decode", "prefill"]
    assert _drained(cluster, "moved") > before
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["scale", "--server", cluster.target]) == 0
    listed = out.getvalue()
    assert all(name in listed for name in roles) and "serving" in listed
    metrics = cluster.cluster.metrics.registry
    actions = {a: metrics.get_sample_value("splitserve_scaling_actions_total",
                                           {"model_name": cluster.cluster.metrics.model_name, "action": a})
               for a in ("add", "remove", "switch")}
    assert actions == {"add": 1, "remove": 2, "switch": 2}     # the SIGTERM's removal is one


def test_the_sla_planner_sizes_the_live_cluster_through_the_admin(cluster, reference):
    """One round of `--planner sla` on this cluster under load (cluster/launch/planner_live.py): the
    snapshot read from the driver's own measurements, SLOs no pool of one worker meets, and the
    rule's actions carried out by the admin while the streams run: the cluster grows within
    --max-workers and every stream still equals the undisturbed output."""
    running = cluster.cluster
    before = dict(_roles(cluster))
    snapshots = LiveSnapshots(running.metrics, running.admin)
    config = PlannerConfig(mode="sla", ttft_slo_s=0.05, itl_slo_s=0.002, max_workers=len(before) + 1)
    planner = LivePlanner(config, load_profile(DEFAULT_PROFILE), snapshots,
                          AdminActuator(running.admin, cluster.loop, timeout_s=120.0))
    prompts = _prompts(6)
    load = _Load(cluster.target, prompts)
    load.wait_started()
    snap = snapshots()
    assert snap.ttft_s > 0 and snap.itl_s > 0 and snap.arrival_rate > 0
    assert {w.name for w in snap.workers} == set(before)
    actions = planner.rule(snap)
    assert actions and all(a.kind is ActionKind.ADD for a in actions), actions
    apply(actions, planner.actuator)
    assert load.finish() == reference(prompts)
    cluster.wait_idle(timeout=30)
    assert len(_roles(cluster)) == len(before) + 1
