"""What crosses the planner's boundary: the metrics snapshot it reads and the actions it returns.

The live cluster (the router's measurements) and the simulator both fill a `MetricsSnapshot`;
an `Actuator` (cluster/planner/loop.py) carries the actions out.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)


@dataclass(frozen=True)
class WorkerSnapshot:
    name: str
    role: str
    running: int = 0                 # sequences in its batch
    queued: int = 0                  # requests waiting for it
    kv_usage: float = 0.0            # share of its KV pool in use
    prefill_tokens_per_s: float = 0.0   # measured while busy (0: not measured this interval)
    decode_step_s: float = 0.0          # measured mean decode step (0: not measured)


@dataclass(frozen=True)
class MetricsSnapshot:
    """One planner interval's measurements (seconds; rates per second)."""
    time_s: float
    interval_s: float
    arrival_rate: float              # requests per second that arrived in the interval
    mean_input_tokens: float
    mean_output_tokens: float
    queue_time_s: float = 0.0        # the longest wait of a request still queued, or finished this interval
    queued_requests: int = 0         # requests waiting for a prefill (or decode) slot now
    ttft_s: float = 0.0              # mean of the interval
    itl_s: float = 0.0
    prefill_tokens_per_s: float = 0.0   # the cluster's, over the interval
    decode_tokens_per_s: float = 0.0
    kv_usage: float = 0.0
    workers: tuple[WorkerSnapshot, ...] = ()
    pending: tuple[str, ...] = ()    # roles of workers added but not serving yet

    def count(self, role: str) -> int:
        return sum(w.role == role for w in self.workers) + sum(r == role for r in self.pending)


class ActionKind(enum.Enum):
    ADD = "add"
    REMOVE = "remove"
    SWITCH = "switch"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    role: str                        # ADD: the new worker's role; REMOVE, SWITCH: the worker's role now
    worker: str | None = None        # REMOVE, SWITCH: which worker
    to_role: str | None = None       # SWITCH: its new role

    def __str__(self) -> str:
        if self.kind is ActionKind.ADD:
            return f"add {self.role}"
        if self.kind is ActionKind.REMOVE:
            return f"remove {self.worker} ({self.role})"
        return f"switch {self.worker} {self.role} -> {self.to_role}"
