"""Batch-invariant mode on the real cluster (Ray, gRPC, NIXL) in the default model's bf16: 32
concurrent greedy requests, each completion equal to `splitserve generate --deterministic` of the
same prompt alone, on 1P1D (every prompt handed off, prefilled beside others) and colocated with
n-gram speculation. bench/determinism.py runs the full matrix (2P2D, draft, EAGLE)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from cluster.launch.app import ClusterConfig
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig
from cluster.types import SamplingParams
from cluster_harness import ClusterThread
from router.client import AsyncClient, Client

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 24
_SNIPPETS = [
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n",
]


def _prompts() -> list[str]:
    """32 prompts: short and long (a few hundred tokens), some sharing long prefixes."""
    out = []
    for i in range(32):
        body = _SNIPPETS[i % 4] * (1 + (i % 5) * 3)
        out.append(f"# task {i}\n{body}" if i % 2 else body + f"    # step {i}\n")
    return out


PROMPTS = _prompts()


def _engine_config(spec="off") -> EngineConfig:
    return EngineConfig(deterministic=True, cache=CacheConfig(num_blocks=1024),
                        speculative=SpeculativeConfig(method=spec, num_speculative_tokens=4))


@pytest.fixture(scope="module")
def reference(single_engine) -> list[list[int]]:
    """Each prompt alone on the single engine (the path of `splitserve generate`), and one of them
    through the real command line."""
    engine = single_engine(_engine_config())
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ref = [list(engine.generate([p], sp)[0].token_ids) for p in PROMPTS]
    cli = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "--log-level", "WARNING", "generate",
                          "--deterministic", "--json", "--ignore-eos", "--max-tokens", str(MAX_TOKENS), PROMPTS[7]],
                         capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(cli.stdout)["token_ids"] == ref[7]
    return ref


def _concurrently(cluster: ClusterThread, **sampling) -> list[list[int]]:
    async def go():
        client = AsyncClient(cluster.target)
        try:
            outs = await asyncio.gather(*(client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
                                          for p in PROMPTS))
        finally:
            await client.close()
        return [list(o.token_ids) for o in outs]
    return asyncio.run(go())


def _mismatches(got, want) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b]


def test_1p1d_concurrent_requests_equal_generate(reference):
    pd = ClusterThread(ClusterConfig(http_port=None, engine=_engine_config(), data_plane=DataPlaneConfig(transport="nixl"), port=0,
                                     router=RouterConfig(local_prefill_max_tokens=4)))
    try:
        assert Client(pd.target).server_info().deterministic
        got = _concurrently(pd)
        stats = pd.wait_idle()
    finally:
        pd.stop()
    assert _mismatches(got, reference) == []
    decode = next(s for s in stats if s.role == "decode")
    assert decode.handoff.done == len(PROMPTS) and decode.handoff.failed == 0


def test_colocated_ngram_concurrent_requests_equal_generate(reference):
    colo = ClusterThread(ClusterConfig(http_port=None, engine=_engine_config("ngram"), colocated=True, port=0))
    try:
        got = _concurrently(colo, speculative="ngram")
        stats = colo.wait_idle()
    finally:
        colo.stop()
    assert _mismatches(got, reference) == []
    assert sum(s.spec_of("ngram").steps for s in stats) > 0, "no verification ran"
