"""The planner's loop: every interval, read a snapshot, decide, act. The live cluster implements
`SnapshotSource` (the router's measurements) and `Actuator` (the admin operations: add a worker of
a role, remove one with a drain, switch one's role); the simulator implements both over its model."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from cluster.planner.snapshot import Action, ActionKind, MetricsSnapshot

log = logging.getLogger(__name__)


class Actuator(Protocol):
    def add(self, role: str) -> None: ...

    def remove(self, name: str) -> None: ...

    def switch(self, name: str, to: str) -> None: ...


class SnapshotSource(Protocol):
    def __call__(self) -> MetricsSnapshot: ...


Rule = Callable[[MetricsSnapshot], "tuple[Action, ...]"]


def apply(actions: tuple[Action, ...], actuator: Actuator, log_each: bool = True) -> None:
    """Carry out `actions` in order (`log_each`: one log line each; the simulator's are counted)."""
    for action in actions:
        if log_each:
            log.info("planner: %s", action)
        if action.kind is ActionKind.ADD:
            actuator.add(action.role)
        elif action.kind is ActionKind.REMOVE:
            actuator.remove(action.worker)
        else:
            actuator.switch(action.worker, action.to_role)


def run_planner(snapshot_source: SnapshotSource, actuator: Actuator, rule: Rule, interval: float,
                stop: threading.Event | None = None, max_rounds: int | None = None,
                sleep: Callable[[float], object] | None = None) -> int:
    """Decide and act every `interval` seconds until `stop` is set (or `max_rounds` done); returns
    the rounds run. An actuator's failure is logged and the next round decides afresh."""
    stop = stop or threading.Event()
    wait = sleep or stop.wait
    rounds = 0
    while not stop.is_set() and (max_rounds is None or rounds < max_rounds):
        started = time.monotonic()
        try:
            apply(rule(snapshot_source()), actuator)
        except Exception:       # the cluster keeps serving whatever one round's failure was
            log.exception("planner: round failed; trying again next interval")
        rounds += 1
        wait(max(0.0, interval - (time.monotonic() - started)))
    return rounds
