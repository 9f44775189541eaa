"""Ray nodes for tests, each a `ray start --block` in its own session, started without forking
the test process.

Why not `ray.init(address="local")` in the test process: Ray starts its GCS and raylet with a
`preexec_fn`, so Python forks the whole process and runs code in the child before exec. Once the
test process has threads calling into gRPC (a cluster's event loop, a client's thread pool), gRPC's
fork handlers can abort that child (SIGABRT before exec: seen as a `[python] <defunct>` child and
"The current node timed out during startup" 30 s later; 1 start in ~10 reproduced it). `Popen`
without a `preexec_fn` execs at once (vfork), so nothing of the test process runs in the child.

Every process a node starts (the worker actors included) stays in the node's session, so a node
is stopped completely by pid whatever state Ray is in."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import free_port


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of every live process in one session."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except (OSError, ProcessLookupError):
                pass
    return {pid: cmd for pid, cmd in out.items() if cmd}    # zombies have an empty command line


def _ray_cli() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else "ray"


def _dies_with_this_process() -> list[str]:
    """A prefix that has the node's `ray start --block` stopped (SIGTERM: it then stops its node)
    if the test process dies without stopping it; util-linux's setpriv execs, so no Python runs
    in the child. PDEATHSIG follows the thread that starts the node: start nodes from the main
    thread."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []


class RayNode:
    """`ray start --block` on `ip` (its node manager and object manager ports chosen here), its
    output in `log_dir/ray-IP.log`. `joining` nodes need RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (see
    tests/e2e/test_multinode.py)."""

    def __init__(self, ip: str, *args: str, joining: bool, log_dir: Path, env: dict[str, str]):
        env = {**os.environ, **env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1" if joining else "0"}
        self.ip = ip
        self.log = log_dir / f"ray-{ip}.log"
        self.proc = subprocess.Popen(
            [*_dies_with_this_process(), _ray_cli(), "start", "--block", "--disable-usage-stats",
             "--node-ip-address", ip, "--node-manager-port", str(free_port(ip)),
             "--object-manager-port", str(free_port(ip)), *args],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def processes(self) -> dict[int, str]:
        return session_processes(self.proc.pid)

    def wait_started(self, timeout: float = 60.0) -> None:
        """`ray start` says so once its node has registered with the head."""
        deadline = time.monotonic() + timeout
        while "Ray runtime started." not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray node {self.ip} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)      # ray start --block stops its node's processes
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.processes():                   # whatever outlived it, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
