"""Runs a real cluster (Ray actors, gRPC on 127.0.0.1) on a background event loop for tests, on
the session's shared Ray (tests/session_ray.py)."""
from __future__ import annotations

import asyncio
import threading
import time

from cluster.launch.app import start_cluster
from session_ray import session_ray, stop_session_ray  # noqa: F401 - the tests' one import


class ClusterThread:
    def __init__(self, cfg):
        session_ray()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cluster = self.run(start_cluster(cfg), timeout=180)
        self.target = f"127.0.0.1:{self.cluster.port}"

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self) -> list[dict]:
        async def go():
            return [await c.stats() for c in self.cluster.workers.values()]
        return self.run(go())

    def wait_idle(self, timeout=15.0) -> list[dict]:
        """Every worker's pool back to empty (no block held, no lease, nothing queued) and nothing
        left in the frontend (no admitted slot, no request in its router). Fails the test (naming
        each worker's figures) if that does not happen within `timeout`."""
        limit = time.monotonic() + timeout
        while True:
            try:
                stats = self.stats()
            except Exception:  # noqa: BLE001 - a worker restarting after a kill: not idle yet
                if time.monotonic() > limit:
                    raise
                time.sleep(0.2)
                continue
            idle = all(s.blocks_used == 0 and s.leases == 0 and s.running == 0 and s.waiting == 0
                       for s in stats)
            front = self._frontend_holds()
            if idle and not any(front.values()):
                return stats
            if time.monotonic() > limit:
                busy = {s.name: {k: getattr(s, k) for k in ("blocks_used", "leases", "running", "waiting")}
                        for s in stats} | {"frontend": front}
                raise AssertionError(f"the cluster is not idle after {timeout:.0f}s: {busy}")
            time.sleep(0.1)

    def _frontend_holds(self) -> dict[str, int]:
        """What the in-process frontend still holds: admitted slots and requests in its router (a
        request the client gave up on ends there a moment after the workers let it go)."""
        frontend = self.cluster.frontend
        if frontend is None:
            return {}
        return {"slots": frontend.service.admission.in_use, "in_flight": frontend.router.in_flight}

    def stop(self):
        self.run(self.cluster.stop(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
