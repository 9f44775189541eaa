"""`splitserve serve` as a user runs it, in a subprocess: start it, learn where it listens from its
stderr, scrape its metrics, stop it with Ctrl-C (and by its process group if that fails)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

# Ray settings that keep every address on loopback (see docs/deploy.md).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}   # Ray auth: serve's own


class ServeProcess:
    def __init__(self, *args: str, timeout: float = 180.0, env: dict | None = None):
        cmd = [sys.executable, "-m", "cluster.launch.cli", "serve", "--port", "0", "--http-port", "0", "--metrics-port", "0",
               *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **RAY_ENV, **(env or {})}, start_new_session=True)
        self.lines: list[str] = []
        self.target = self.metrics_url = self.http_url = None
        deadline = time.monotonic() + timeout
        banner_done = False
        while not banner_done:
            line = self.proc.stderr.readline()
            if not line and (self.proc.poll() is not None or time.monotonic() > deadline):
                self.stop()
                raise RuntimeError("serve did not start:\n" + "".join(self.lines[-40:]))
            self.lines.append(line)
            # The banner (cluster/launch/banner.py), whose last line is the gRPC command to try.
            if m := re.search(r"^  metrics: (http://\S+)", line):
                self.metrics_url = m.group(1)
            if m := re.search(r"^  OpenAI API: (https?://\S+)/v1", line):
                self.http_url = m.group(1)
            if m := re.search(r"^  gRPC: (\S+:\d+)", line):
                self.target = m.group(1)
            banner_done = line.startswith("  try: splitserve generate --server")
        # Keep draining stderr so a chatty server never blocks on a full pipe.
        self._drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._drain.start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def metrics(self) -> str:
        return urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()

    def stop(self, timeout: float = 60.0) -> int | None:
        """Ctrl-C, as a user stops it; the process group is killed if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                return None
        return self.proc.returncode


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in a Prometheus text exposition (labels matched exactly)."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None
