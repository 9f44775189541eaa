"""The test session's shared Ray: one local node on loopback, as a long-running `ray start` serves
many `splitserve serve` runs; every in-process cluster of the session joins it (a cluster's stop
kills its actors, and Ray's start and stop are paid once, not per cluster).

The node runs in a `ray start --block` of its own (tests/ray_nodes.py says why Ray is never
started by forking the test process), and this process joins it as a driver."""
from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from pathlib import Path

from helpers import free_port
from ray_nodes import RayNode

# Logical CPUs only: enough that actors of a cluster still being killed never hold up the next one's.
SESSION_RAY_CPUS = 64
# Loopback, but not 127.0.0.1: a driver whose `ray` was imported before ray_environment() ran
# rewrites 127.0.0.1 to the host's external address, where the node does not listen.
_HOST = "127.0.0.9"


class _SessionNode:
    """Owns the node and its log folder; `None` between a stop and the next start."""
    node: RayNode | None = None
    log_dir: Path | None = None
    address = ""


def session_ray() -> None:
    """Start the session's node and join it, unless this process has joined one. From the main
    thread only: the node is stopped when the thread that started it ends (PDEATHSIG)."""
    from cluster.launch.app import ray_environment
    ray_environment()
    import ray
    if ray.is_initialized():
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("start the session's Ray from the main thread (session_ray()) before a thread "
                           "starts a cluster: the node is stopped when the thread that started it ends")
    if _SessionNode.node is None:
        _SessionNode.log_dir = Path(tempfile.mkdtemp(prefix="splitserve-session-ray-"))
        port = free_port(_HOST)
        node = RayNode(_HOST, "--head", "--port", str(port), "--num-cpus", str(SESSION_RAY_CPUS),
                       # Ray's client server binds 127.0.0.1 whatever the node's address: a port free there.
                       "--include-dashboard", "false", "--ray-client-server-port", str(free_port("127.0.0.1")),
                       joining=False, log_dir=_SessionNode.log_dir, env={})
        _SessionNode.node = node
        try:
            node.wait_started()
        except Exception:
            stop_session_ray()
            raise
        _SessionNode.address = f"{_HOST}:{port}"
    ray.init(address=_SessionNode.address, log_to_driver=False)


def stop_session_ray() -> None:
    """Leave and stop the session's node (the next cluster starts one again): for tests whose own
    Ray nodes should have the machine's ports and cores to themselves, before tests that run
    without Ray, and at the session's end."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    node, _SessionNode.node = _SessionNode.node, None
    if node is not None:
        node.stop()
        left = node.processes()
        if left:
            raise RuntimeError(f"the session's Ray node left processes running: {left}")
    if _SessionNode.log_dir is not None:
        shutil.rmtree(_SessionNode.log_dir, ignore_errors=True)
        _SessionNode.log_dir = None
