"""The thread that drives a worker's KV handoffs, apart from its engine thread.

A handoff's messages (DONE, ACK, RENEW) and the transport's progress must not wait for an engine
step: on a CPU a prefill step of a few thousand tokens takes seconds, and a producer that answered
only between steps made the consumer's reads and confirmations time out behind them (1P1D at 16
streams of 512-token prompts: most handoffs failed and were recomputed). So each worker runs its
producer's or consumer's `poll` here, while something is in flight, and the work that touches the
engine (freeing a lease's blocks, joining a pulled sequence to the batch) goes back to the engine
thread as a command (`EngineLoop.soon`).

Nothing spins when idle: `poll` returns the seconds until it next needs a turn, or None when
nothing is in flight, and the thread then sleeps until `wake` (a lease or a pull has started).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class KVProgress:
    def __init__(self, poll: Callable[[], "float | None"], name: str):
        self.poll = poll
        self.turns = 0                   # polls run (tests read it: an idle thread must not turn)
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Something was put in flight: poll now, and keep polling while `poll` asks to."""
        self._wake.set()

    def _run(self) -> None:
        wait: float | None = None
        while True:
            self._wake.wait(timeout=wait)
            self._wake.clear()           # before the poll: a wake during it is not lost
            if self._stop:
                return
            self.turns += 1
            try:
                wait = self.poll()
            except Exception:  # noqa: BLE001 - a failing poll must not stop the handoffs
                log.exception("KV progress poll failed")
                wait = 0.01

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
