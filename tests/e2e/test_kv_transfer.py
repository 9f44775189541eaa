"""KV handoff between two real processes over real transports (NIXL/UCX, TCP)."""
from __future__ import annotations

import time

import pytest
import torch

from conftest import connect
from cluster.config import CacheConfig, EngineConfig
from cluster.types import KVHandle, SamplingParams

pytestmark = pytest.mark.slow   # worker processes over three transports

def _available(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


TRANSPORTS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not _available("nixl"), reason="nixl not installed")),
    pytest.param("ucx", marks=pytest.mark.skipif(not _available("ucxx"), reason="ucxx not installed")),
    "tcp",
]
# Non-contiguous on purpose: the producer holds other requests' blocks between this one's.
PROMPT = torch.randint(3, 384, (37,), generator=torch.Generator().manual_seed(11)).tolist()
MAX_TOKENS = 12
IDLE = {"used": 0, "held": 0, "leases": 0}


def _prompt(seed: int) -> list[int]:
    """A test's own prompt: the module's workers are shared, and their prefix caches must not
    answer one test with another's blocks (a corrupted one included)."""
    return torch.randint(3, 384, (37,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair(worker_set):
    """One producer and one consumer process per transport for the whole module (started on first
    use, connected once); tests that kill a process or need another layout start their own."""
    pairs = {}

    def get(transport):
        if transport not in pairs:
            p = worker_set.start(transport, f"p-{transport}")
            d = worker_set.start(transport, f"d-{transport}")
            connect(p, d)
            pairs[transport] = (p, d)
        p, d = pairs[transport]
        p.call("configure", lease_seconds=30.0)
        d.call("configure", timeout_s=10.0)
        assert _idle(p) == IDLE and _idle(d) == IDLE   # the previous test left nothing behind
        return p, d
    return get


@pytest.fixture(scope="module")
def reference(tiny_model_dir, single_engine):
    engine = single_engine(EngineConfig(model=tiny_model_dir("llama"), dtype="float32",
                                    cache=CacheConfig(block_size=4, num_blocks=96)))
    return list(engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS))[0].token_ids)


def _idle(worker, timeout=10.0):
    limit = time.monotonic() + timeout
    while True:
        state = worker.call("pool")
        if state == IDLE or time.monotonic() > limit:
            return state
        time.sleep(0.1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_moves_noncontiguous_blocks_and_decode_matches_single_engine(transport, pair, reference):
    """The first test on each transport's pair: its pools are fresh, so the pad request below
    makes the prompt's blocks non-contiguous."""
    p, d = pair(transport)
    p.call("prefill", rid="pad", prompt=PROMPT[:9])   # blocks 0, 1 (full, cached) and 2 (partial)
    raw = p.call("prefill", rid="r1", prompt=PROMPT)   # reuses 0 and 1, skips 2: non-contiguous
    p.call("abort_producer", rid="pad")
    raw2 = p.call("prefill", rid="r2", prompt=PROMPT)
    ids = KVHandle.decode(raw).block_ids
    assert list(ids) != list(range(ids[0], ids[0] + len(ids))), ids
    src = p.call("source_bytes", handle=raw)
    got = d.call("pull", handle=raw, prompt=PROMPT, rid="r1", max_tokens=MAX_TOKENS, bytes_only=True)
    assert got["state"] == "done" and got["bytes"] == src
    # Again, now continuing the decode from the transferred KV.
    out = d.call("pull", handle=raw2, prompt=PROMPT, rid="r2", max_tokens=MAX_TOKENS)
    assert out["state"] == "done"
    assert out["tokens"] == reference
    assert _idle(p) == IDLE
    assert _idle(d) == IDLE


@pytest.mark.parametrize("transport", TRANSPORTS[:1])
def test_a_peer_without_the_cluster_secret_cannot_complete_a_handoff(transport, pair, spawn_worker):
    """Another secret, over NIXL: its one-sided read lands (NIXL has no per-request permission,
    docs/security.md), but its DONE does not open at the producer, so it never gets the ACK it
    needs to use the blocks; the pull fails and nothing is leaked on either side. (TCP refuses such
    a peer at its hello: tests/e2e/test_security.py; every other test here runs sealed.)"""
    p, _ = pair(transport)
    d = spawn_worker(transport, f"sd-{transport}", secret="another-secret-entirely-0123456789", timeout_s=2.0)
    connect(p, d)
    prompt = _prompt(21)
    raw = p.call("prefill", rid="s1", prompt=prompt)
    out = d.call("pull", handle=raw, prompt=prompt, rid="s1", max_tokens=MAX_TOKENS)
    assert out["state"] == "failed", out
    p.call("abort_producer", rid="s1")
    assert _idle(p) == IDLE
    assert _idle(d) == IDLE


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layout_mismatch_is_refused_naming_the_field(transport, pair, spawn_worker):
    p, _ = pair(transport)
    d = spawn_worker(transport, f"ld-{transport}", block_size=8)
    reply = d.call("add_peer", meta=p.call("meta"))
    assert "LayoutMismatch" in reply["error"] and "block_size: local 8, peer 4" in reply["error"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_source_is_detected_and_both_pools_recover(transport, pair):
    p, d = pair(transport)
    prompt = _prompt(22)
    raw = p.call("prefill", rid="c1", prompt=prompt)
    p.call("corrupt", handle=raw, index=3, layer=1)
    out = d.call("pull", handle=raw, prompt=prompt, rid="c1", max_tokens=MAX_TOKENS)
    assert out["state"] == "failed" and "checksum mismatch in 1 of" in out["error"]
    assert _idle(p) == IDLE
    assert _idle(d) == IDLE


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_on_either_side_frees_both_pools(transport, pair):
    p, d = pair(transport)
    prompt = _prompt(23)
    raw = p.call("prefill", rid="a1", prompt=prompt)          # producer-side abort before any read
    assert p.call("abort_producer", rid="a1")["found"]
    out = d.call("pull", handle=raw, prompt=prompt, rid="a1", max_tokens=MAX_TOKENS)
    assert out["state"] == "failed"                             # the lease had ended: the copy is void
    raw = p.call("prefill", rid="a2", prompt=prompt)          # consumer-side abort mid-pull
    out = d.call("pull", handle=raw, prompt=prompt, rid="a2", max_tokens=MAX_TOKENS, abort_after_start=True)
    assert out["state"] == "failed" and "aborted" in out["error"]
    assert _idle(p) == IDLE
    assert _idle(d) == IDLE


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_consumer_killed_mid_transfer_producer_releases_after_lease(transport, pair, spawn_worker):
    p, _ = pair(transport)
    p.call("configure", lease_seconds=2.0)
    d = spawn_worker(transport, f"kd-{transport}")
    connect(p, d)
    raw = p.call("prefill", rid="k1", prompt=_prompt(24))
    assert p.call("pool")["leases"] == 1
    d.send("pull_and_hang", handle=raw)
    time.sleep(0.3)
    d.kill()
    t0 = time.monotonic()
    assert _idle(p, timeout=10) == IDLE
    assert time.monotonic() - t0 < 8


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_producer_killed_consumer_fails_within_timeout(transport, pair, spawn_worker):
    _, d = pair(transport)
    d.call("configure", timeout_s=3.0)
    p = spawn_worker(transport, f"xp-{transport}")
    connect(p, d)
    prompt = _prompt(25)
    raw = p.call("prefill", rid="x1", prompt=prompt)
    p.kill()
    t0 = time.monotonic()
    out = d.call("pull", handle=raw, prompt=prompt, rid="x1", max_tokens=MAX_TOKENS, timeout=30)
    assert out["state"] == "failed"
    assert time.monotonic() - t0 < 3.0 + 4.0
    assert _idle(d) == IDLE
