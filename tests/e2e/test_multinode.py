"""A real multi-node Ray cluster on this machine: `ray start --head` plus two worker nodes joined with
`ray start --address`, each advertising its role as a custom resource, and `splitserve serve
--ray-address` placing the prefill worker on one node and the decode worker on another.

Every node gets its own loopback address (127.0.0.2-4, as if on three hosts). A joining node must
run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, and with it Ray rewrites a bootstrap address of
127.0.0.1 to the host's external one; 127.0.0.2 is loopback but not rewritten. Each node is a
`ray start --block` in its own session (tests/ray_nodes.py), so the test finds every process a node
started (the worker actors included) by session id, and stops them all by pid."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
from served_cluster import RAY_ENV, ServeProcess, sample  # noqa: E402
from helpers import free_port  # noqa: E402
from cluster_harness import stop_session_ray  # noqa: E402
from ray_nodes import RayNode  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HEAD, PREFILL, DECODE = "127.0.0.2", "127.0.0.3", "127.0.0.4"
# The nodes run with Ray's token authentication; serve joins with --ray-token-file.
TOKEN = secrets.token_hex(32)
RAY_ENV = {**RAY_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\ndef main():\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):\n    print(", "def read_lines(path):\n    with open(path) as f:"]
MAX_TOKENS = 12
SERVED_NAME = "multinode"     # --served-model-name: the model_name of every series
DECODE_NIXL = {"worker": "decode-0", "transport": "nixl", "model_name": SERVED_NAME}   # the handoff series' labels


def _alive_nodes(address: str) -> int:
    out = subprocess.run([sys.executable, "-c", "import ray; ray.init(address=%r, log_to_driver=False); "
                          "print(sum(n['Alive'] for n in ray.nodes()))" % address],
                         capture_output=True, text=True, env={**os.environ, **RAY_ENV}, timeout=60)
    return int(out.stdout.split()[-1]) if out.returncode == 0 else 0


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory):
    stop_session_ray()   # the three nodes below are this machine's only Ray
    log_dir = tmp_path_factory.mktemp("ray-nodes")
    port = free_port(HEAD)
    address = f"{HEAD}:{port}"
    nodes = []
    try:
        # The head holds no CPU, so no worker can land there: it runs only Ray's own services and the router.
        nodes.append(RayNode(HEAD, "--head", "--port", str(port), "--num-cpus", "0", "--include-dashboard", "false",
                             "--ray-client-server-port", str(free_port(HEAD)), joining=False, log_dir=log_dir, env=RAY_ENV))
        nodes[0].wait_started()
        # One node at a time: nodes started together race for the same free ports.
        for ip, role in ((PREFILL, "prefill"), (DECODE, "decode")):
            nodes.append(RayNode(ip, "--address", address, "--num-cpus", "2", "--resources", f'{{"{role}": 1}}',
                                 joining=True, log_dir=log_dir, env=RAY_ENV))
            nodes[-1].wait_started()
        assert _alive_nodes(address) == 3
        yield address, dict(zip(("head", "prefill", "decode"), nodes))
    finally:
        for node in reversed(nodes):
            node.stop()
        left = {n.ip: n.processes() for n in nodes}
        assert not any(left.values()), f"processes left running: {left}"


@pytest.fixture(scope="module")
def reference(single_engine):
    from cluster.config import EngineConfig
    from cluster.types import SamplingParams
    engine = single_engine(EngineConfig(dtype="float32"))
    return [list(o.token_ids) for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))]


def _actors(node: RayNode, cls: str) -> list[int]:
    return [pid for pid, cmd in node.processes().items() if cmd.startswith(f"ray::{cls}")]


def test_prefill_and_decode_on_their_own_nodes_router_on_head(ray_nodes, reference):
    from router.client import Client
    address, nodes = ray_nodes
    token_file = nodes["head"].log.parent / "ray-token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    serve = ServeProcess("--ray-address", address, "--ray-token-file", str(token_file), "--dtype", "float32",
                         "--transport", "nixl", "--prefill-resources", '{"prefill": 1}',
                         "--decode-resources", '{"decode": 1}', "--local-prefill-max-tokens", "4",
                         "--served-model-name", SERVED_NAME,
                         env={"RAY_AUTH_TOKEN": "not-the-token"})   # the file wins over an inherited token
    try:
        # Placement, seen from the operating system: each actor's process belongs to its node's session.
        assert len(_actors(nodes["prefill"], "PrefillWorker")) == 1, nodes["prefill"].processes()
        assert len(_actors(nodes["decode"], "DecodeWorker")) == 1, nodes["decode"].processes()
        assert not _actors(nodes["prefill"], "DecodeWorker") and not _actors(nodes["decode"], "PrefillWorker")
        assert not _actors(nodes["head"], "PrefillWorker") and not _actors(nodes["head"], "DecodeWorker")
        assert "(the head)" in serve.log, serve.log[-3000:]

        client = Client(serve.target)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS), PROMPTS))
        assert [list(o.token_ids) for o in outs] == reference

        # The KV crossed nodes over NIXL: every prompt is longer than the local-prefill threshold.
        deadline = time.monotonic() + 10
        while True:
            text = serve.metrics()
            done = sample(text, "splitserve_kv_transfers_total", **DECODE_NIXL)
            if done == len(PROMPTS) or time.monotonic() > deadline:
                break
            time.sleep(0.3)                               # the router polls worker stats every 0.25 s
        assert done == len(PROMPTS), text
        assert sample(text, "splitserve_kv_transfer_bytes_total", **DECODE_NIXL) > 0
        assert sample(text, "splitserve_kv_transfer_failures_total", **DECODE_NIXL) == 0
    finally:
        assert serve.stop() == 0, serve.log[-3000:]
    # Stopping the server ends its actors but leaves the user's Ray cluster running.
    deadline = time.monotonic() + 15
    while (_actors(nodes["prefill"], "PrefillWorker") or _actors(nodes["decode"], "DecodeWorker")) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _actors(nodes["prefill"], "PrefillWorker") and not _actors(nodes["decode"], "DecodeWorker")
    assert _alive_nodes(address) == 3
