"""Whether a worker may be given work: liveness, not latency.

A worker is dead when Ray says so (a call to it raises `RayActorError`: the actor died or is
restarting), and it is back when it answers as a new incarnation (every worker draws a fresh id
when it starts). A poll that is merely slow changes nothing: a busy worker keeps getting work. A
worker that is alive but makes no progress while it has work queued (its engine step counter
stands still for `stall_s`) is stuck: routed around until it moves again. A worker is READY only
once it says it has loaded and been handshaken, so none gets work while it loads or reconnects.

Plain Python, fed with poll outcomes and a clock: the policy is unit-tested without Ray.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.worker_messages import WorkerStats


class Liveness(enum.Enum):
    STARTING = "starting"    # not answered yet, or a (new) incarnation not yet handshaken
    READY = "ready"
    STALLED = "stalled"      # alive, work queued, no engine step for `stall_s`
    DEAD = "dead"            # Ray: the actor died or is restarting


class Change(enum.Enum):
    NONE = "none"
    NEW_INCARNATION = "new_incarnation"   # (re)started; READY too if it already says it is ready
    STALLED = "stalled"
    RECOVERED = "recovered"               # a stalled worker progresses again
    DIED = "died"


def is_actor_death(exc: BaseException) -> bool:
    """True when Ray reports the actor dead or restarting (not a task's own error)."""
    try:
        from ray.exceptions import RayActorError  # noqa: PLC0415 - the router's modules import no ray (clients, harness)
    except ImportError:   # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, RayActorError)


@dataclass
class WorkerHealth:
    name: str
    stall_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    state: Liveness = Liveness.STARTING
    incarnation: str | None = None
    steps: int = -1
    moved_at: float = 0.0          # when the step counter last advanced, or work was last absent

    @property
    def routable(self) -> bool:
        return self.state is Liveness.READY

    def observe(self, stats: WorkerStats) -> Change:
        """A stats poll answered. `stats.ready` is the worker's own word that it has loaded
        and been handshaken with its peers (the driver sets it after each (re)start)."""
        now = self.clock()
        change = Change.NONE
        if stats.incarnation != self.incarnation:
            self.incarnation, self.steps, self.moved_at = stats.incarnation, stats.steps, now
            self.state = Liveness.STARTING
            change = Change.NEW_INCARNATION
        if self.state in (Liveness.STARTING, Liveness.DEAD):
            if not stats.ready:
                return change
            # DEAD yet the same incarnation answers: the error was transient; it kept its peers.
            was_dead = self.state is Liveness.DEAD and change is Change.NONE
            self.state, self.moved_at = Liveness.READY, now
            return Change.RECOVERED if was_dead else change
        steps = stats.steps
        if steps != self.steps or not stats.has_work:
            self.steps, self.moved_at = steps, now
            if self.state is Liveness.STALLED:
                self.state = Liveness.READY
                return Change.RECOVERED
            return Change.NONE
        if self.state is Liveness.READY and now - self.moved_at > self.stall_s:
            self.state = Liveness.STALLED
            return Change.STALLED
        return Change.NONE

    def died(self) -> Change:
        if self.state is Liveness.DEAD:
            return Change.NONE
        self.state = Liveness.DEAD
        return Change.DIED
