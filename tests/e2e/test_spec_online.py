"""Online adaptation with a real cluster (`--spec-online`): real Ray, gRPC and NIXL, two decode
workers and the trainer actor. An opted-in tenant's traffic trains a head that is promoted only
when it wins on held-out traffic, served by every decode worker at the same version; a degraded
head is rolled back after one window; a restarted worker gets the live version back; a restarted
trainer resumes the newest kept head from --spec-online-dir; another
tenant's traffic is never kept; greedy output always equals the single engine without speculation."""
from __future__ import annotations

import glob
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig, SpeculativeConfig
from cluster.launch.app import ClusterConfig
from cluster.secrets import ApiKey
from cluster.types import SamplingParams
from cluster_harness import ClusterThread
from router.client import Client
from router.router import RouterConfig

pytestmark = pytest.mark.ray

KEYS = {"acme": "key-acme-0123456789", "other": "key-other-0123456789"}
# Unseen code: the standard library's json and email packages, cut at a few places.
SOURCES = [open(f).read() for f in sorted(glob.glob("/usr/lib/python3*/json/*.py"))[:5]]
PROMPTS = [src[a:a + 400] for a in (0, 400, 800) for src in SOURCES]
MAX_TOKENS = 48


def _engine_config(**online) -> EngineConfig:
    # A fixed k: the window counts verifications. Batch-invariant: requests are served concurrently
    # and compared with plain decoding one engine, one batch (docs/determinism.md).
    return EngineConfig(num_threads=1, cache=CacheConfig(num_blocks=512), deterministic=True, speculative=SpeculativeConfig(
        method="eagle", num_speculative_tokens=4, **online))


@pytest.fixture(scope="module")
def reference(single_engine):
    engine = single_engine(_engine_config())
    return {p: list(c.token_ids) for p, c in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS)))}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    heads_dir = tmp_path_factory.mktemp("online-heads")
    engine = _engine_config(spec_online=True, spec_online_tenants="acme", spec_online_min_tokens=400,
                            spec_online_steps=40, spec_online_window=40, spec_online_interval_s=0.5,
                            spec_online_dir=heads_dir)
    c = ClusterThread(ClusterConfig(http_port=None, engine=engine, num_decode=2, port=0, metrics_port=0,
                                    data_plane=DataPlaneConfig(transport="nixl"),
                                    router=RouterConfig(local_prefill_max_tokens=4),
                                    api_keys=tuple(ApiKey(t, k.encode()) for t, k in KEYS.items())))
    c.heads_dir = heads_dir
    yield c
    c.stop()


def _serve(c: ClusterThread, tenant: str, reference, prompts=PROMPTS) -> None:
    """The prompts at once (both decode workers serve), each checked against plain decoding."""
    def one(prompt):
        return list(Client(c.target, api_key=KEYS[tenant]).generate(prompt, max_tokens=MAX_TOKENS, timeout=120).token_ids)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, prompts))
    assert outs == [reference[p] for p in prompts]


def _status(c: ClusterThread):
    return ray.get(c.cluster.online_trainer.status.remote(), timeout=60)


def _serve_until(c: ClusterThread, reference, done, rounds: int = 12):
    for _ in range(rounds):
        _serve(c, "acme", reference)
        status = _status(c)
        if done(status):
            return status
        time.sleep(1.0)
    raise AssertionError(f"not reached after {rounds} rounds: {_status(c)}")


def _heads(c: ClusterThread) -> dict[str, dict[str, tuple[int, int]]]:
    """Per decode worker: tenant -> (live version, rollbacks)."""
    return {s.name: {h.tenant: (h.version, h.rollbacks) for h in s.spec_heads} for s in c.stats() if s.role == "decode"}


def test_traffic_trains_a_head_that_every_decode_worker_serves(cluster, reference):
    _serve(cluster, "other", reference, PROMPTS[:4])
    status = _serve_until(cluster, reference, lambda s: any(e.kind == "promoted" for e in s.events))
    promoted = next(e for e in status.events if e.kind == "promoted")
    assert promoted.score > promoted.other, "promoted only when it beat the live head on held-out traffic"
    assert dict(status.live)["acme"] == promoted.version
    assert "other" not in dict(status.buffered_tokens), "a tenant that did not opt in is never kept"
    heads = _heads(cluster)
    assert sorted(heads) == ["decode-0", "decode-1"]
    assert all(h == {"acme": (promoted.version, 0)} for h in heads.values()), heads
    # --spec-online-dir: the promoted head, and nothing else, was written (nothing of "other").
    from decode.spec.compat import weights_fingerprint
    from decode.spec.online.messages import TRAINABLE, unpack_tensors
    written = sorted(str(f.relative_to(cluster.heads_dir)) for f in cluster.heads_dir.rglob("*") if f.is_file())
    assert f"acme/v{promoted.version}/trainable.safetensors" in written and all(w.startswith("acme/v") for w in written)
    folder = cluster.heads_dir / "acme" / f"v{promoted.version}"
    assert sorted(unpack_tensors((folder / "trainable.safetensors").read_bytes(), TRAINABLE)) == sorted(TRAINABLE)
    assert (folder / "target_fingerprint").read_text() == weights_fingerprint(cluster.cluster.config.engine.model)
    _serve(cluster, "acme", reference)      # served by the new head: the output is unchanged
    _serve(cluster, "other", reference, PROMPTS[:4])
    # The live version reaches Prometheus (the trainer may have promoted again meanwhile: compare
    # with what the worker says now).
    port = cluster.cluster.metrics_server[0].server_port
    series = f'splitserve_spec_head_version{{model_name="{cluster.cluster.model_name}",tenant="acme",worker="decode-1"}}'
    deadline = time.monotonic() + 15
    while True:
        version = _heads(cluster)["decode-1"]["acme"][0]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        if f"{series} {float(version)}" in text:
            break
        assert time.monotonic() < deadline, [line for line in text.splitlines() if "spec_head" in line]
        time.sleep(0.5)


def test_a_worse_head_is_rolled_back_within_one_window(cluster, reference):
    bad = ray.get(cluster.cluster.online_trainer.inject_degraded.remote("acme", 3.0), timeout=60)
    assert all(h["acme"] == (bad, 0) for h in _heads(cluster).values())
    # The head it replaced: the last promoted before it (a round may have promoted one while the
    # drill waited for the trainer's lock, so not necessarily the one live before the call).
    live = max((e.version for e in _status(cluster).events if e.kind == "promoted" and e.version < bad), default=0)
    status = _serve_until(cluster, reference, lambda s: any(e.kind == "rolled_back" for e in s.events), rounds=6)
    rolled = next(e for e in status.events if e.kind == "rolled_back")
    assert rolled.version == bad and rolled.score < rolled.other
    assert dict(status.live)["acme"] == live
    heads = _heads(cluster)     # a later round may already have promoted again: the same version everywhere
    assert all(h["acme"][1] == 1 for h in heads.values()) and len({h["acme"][0] for h in heads.values()}) == 1, heads


def test_a_restarted_decode_worker_gets_the_live_version_back(cluster, reference):
    assert dict(_status(cluster).live)["acme"] > 0
    old = next(s for s in cluster.stats() if s.name == "decode-1")
    os.kill(old.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:     # the trainer may promote meanwhile: the restarted worker must serve whatever is live
            live, heads = dict(_status(cluster).live)["acme"], _heads(cluster)
            back = next(s for s in cluster.stats() if s.name == "decode-1").incarnation != old.incarnation
        except Exception:  # noqa: BLE001 - restarting
            live, heads, back = None, {}, False
        if back and heads.get("decode-1", {}).get("acme", (None,))[0] == live == heads["decode-0"]["acme"][0]:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"decode-1 did not come back on the live version: {_heads(cluster)}")
    _serve(cluster, "acme", reference)
    stats = cluster.wait_idle(timeout=60)
    assert all(s.blocks_used == 0 for s in stats)


def _newest_kept(heads_dir) -> int:
    kept = [int(v.name[1:]) for v in (heads_dir / "acme").glob("v*") if (v / "state").read_text() == "kept"]
    return max(kept, default=0)


def test_a_restarted_trainer_resumes_the_newest_kept_head_from_its_directory(cluster, reference):
    """Its memory died with it; --spec-online-dir did not. It resumes the newest version that held
    up over its window (never one still on probation, which nobody judged), and every worker
    serves that one. Ray restarts it; it starts polling by itself."""
    _serve_until(cluster, reference, lambda s: any(e.kind == "kept" for e in s.events))
    ray.kill(cluster.cluster.online_trainer, no_restart=False)
    want = _newest_kept(cluster.heads_dir)      # the dead trainer writes nothing more
    assert want > 0
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            heads, live = _heads(cluster), dict(_status(cluster).live).get("acme")
        except Exception:  # noqa: BLE001 - restarting
            heads, live = {}, None
        if live == want and heads and all(h["acme"][0] == want for h in heads.values()):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"not on v{want}: {_heads(cluster)}")
    _serve(cluster, "acme", reference)
