"""More models than memory (`--max-loaded-models K`, docs/models.md): at most K models' weights are
loaded at once; a request for another model waits until one is loaded for it, and the least
recently used idle model is released to make room (never one with requests running).

Which waiting request goes next is `next_step`, plain functions over plain values:

- `fcfs`: arrival order. The oldest waiting request's model is loaded as soon as a slot frees; the
  requests behind it wait, even those whose model is loaded (head of line), so a mixed load
  switches models about as often as its requests change model.
- `grouped` (Symbolic MoE's grouped batching): every waiting request of a loaded model goes at
  once (one load serves them all); when none is left for the loaded models and one of them is
  idle, the model with the most waiting requests is loaded (ties: the oldest's). Fairness: once a
  request of an unloaded model has waited `max_wait_s`, no request of the loaded models younger
  than it is let in until its model is loaded (the oldest such request first), so none waits
  forever (and two overdue models never swap each other out before either serves a request).

`ModelSwapGate` applies it in the frontend's loop: `Router.generate` holds `serving(model)` for the
life of each request; the loads and releases are the workers' (`ModelLoader`, injected).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

log = logging.getLogger(__name__)


class ModelScheduling(Enum):
    GROUPED = "grouped"
    FCFS = "fcfs"


@dataclass(frozen=True)
class Waiting:
    model: str
    arrived: float       # monotonic seconds


@dataclass(frozen=True)
class Step:
    """What to do now: let `admit` (indices into the waiting list) in; release `evict` (None: a
    slot is free) and load `load` (None: no load now)."""
    admit: tuple[int, ...] = ()
    load: str | None = None
    evict: str | None = None


def idle_victim(loaded: Sequence[str], running: Mapping[str, int]) -> str | None:
    """The least recently used loaded model with nothing running (`loaded`: least recent first)."""
    return next((m for m in loaded if not running.get(m)), None)


def _load_for(target: str | None, admit: tuple[int, ...], loaded: Sequence[str], running: Mapping[str, int],
              capacity: int) -> Step:
    if target is None:
        return Step(admit)
    if len(loaded) < capacity:
        return Step(admit, load=target)
    victim = idle_victim(loaded, running)
    return Step(admit, load=target, evict=victim) if victim is not None else Step(admit)


def next_step(waiting: Sequence[Waiting], loaded: Sequence[str], running: Mapping[str, int], capacity: int,
              scheduling: ModelScheduling, now: float, max_wait_s: float) -> Step:
    """The next step for `waiting` (in arrival order), with `loaded` models (least recently used
    first; a model being loaded counts as loaded, and is not in it), `running` requests per model
    and `capacity` model slots. No load is asked while one is in flight (the caller's rule)."""
    if scheduling is ModelScheduling.FCFS:
        admit = []
        for i, w in enumerate(waiting):
            if w.model not in loaded:
                return _load_for(w.model, tuple(admit), loaded, _with(running, waiting, admit), capacity)
            admit.append(i)
        return Step(tuple(admit))
    overdue = next((w for w in waiting if w.model not in loaded and now - w.arrived >= max_wait_s), None)
    if overdue is not None:     # the fairness bound: only requests older than it are let in
        admit = tuple(i for i, w in enumerate(waiting) if w.model in loaded and w.arrived <= overdue.arrived)
        return _load_for(overdue.model, admit, loaded, _with(running, waiting, admit), capacity)
    admit = tuple(i for i, w in enumerate(waiting) if w.model in loaded)
    others = Counter(w.model for w in waiting if w.model not in loaded)
    if not others:
        return Step(admit)
    first_seen = {}
    for i, w in enumerate(waiting):
        first_seen.setdefault(w.model, i)
    target = max(others, key=lambda m: (others[m], -first_seen[m]))
    return _load_for(target, admit, loaded, _with(running, waiting, admit), capacity)


def _with(running: Mapping[str, int], waiting: Sequence[Waiting], admit) -> dict[str, int]:
    """`running` with the requests let in by this step: their models are not idle."""
    busy = dict(running)
    for i in admit:
        busy[waiting[i].model] = busy.get(waiting[i].model, 0) + 1
    return busy


class ModelLoader(Protocol):
    """One model's workers, as the gate loads and releases them (cluster/launch/model_swap.py)."""

    async def load(self) -> None: ...

    async def unload(self) -> None: ...


@dataclass
class _Waiter:
    waiting: Waiting
    admitted: asyncio.Future


class ModelSwapGate:
    """The frontend's one view of which models are loaded; every model's router holds `serving`."""

    def __init__(self, capacity: int, scheduling: ModelScheduling, max_wait_s: float, clock=time.monotonic):
        self.capacity = capacity
        self.scheduling = scheduling
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.loaders: dict[str, ModelLoader] = {}
        self.loaded: list[str] = []           # least recently used first
        self.running: Counter = Counter()     # requests let in and not yet ended, per model
        self.loads: Counter = Counter()       # loads done by the gate, per model
        self._waiters: list[_Waiter] = []
        self._swap: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    def register(self, model: str, loader: ModelLoader, first: bool = False) -> None:
        """A model whose workers have started, weights loaded (`trim` releases beyond capacity).
        `first`: it is the one kept loaded before those registered earlier."""
        self.loaders[model] = loader
        self.loaded.append(model)
        if first:
            self.loaded.insert(0, self.loaded.pop())

    async def trim(self) -> None:
        """Release the models registered beyond capacity, the latest first (at start-up, none running)."""
        while len(self.loaded) > self.capacity:
            await self.loaders[self.loaded.pop()].unload()

    @asynccontextmanager
    async def serving(self, model: str):
        """Hold a place for one request of `model` while it runs: wait until its model is loaded
        and the policy lets it in. A model the gate does not manage passes at once."""
        if model not in self.loaders:
            yield
            return
        waiter = _Waiter(Waiting(model, self.clock()), asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._pump()
        try:
            await waiter.admitted
        except BaseException:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.admitted.done() and not waiter.admitted.cancelled() and waiter.admitted.exception() is None:
                self._release(model)     # let in, but cancelled before it ran
            raise
        try:
            yield
        finally:
            self._release(model)

    def _release(self, model: str) -> None:
        self.running[model] -= 1
        self._pump()

    def _pump(self) -> None:
        """Let in what the policy allows now, and start a load when it asks for one."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waits = [w.waiting for w in self._waiters]
        step = next_step(waits, self.loaded, self.running, self.capacity - (self._swap is not None),
                         self.scheduling, self.clock(), self.max_wait_s)
        for i in step.admit:
            w = self._waiters[i]
            self.running[w.waiting.model] += 1
            self._touch(w.waiting.model)
            w.admitted.set_result(None)
        admitted = set(step.admit)
        self._waiters = [w for i, w in enumerate(self._waiters) if i not in admitted]
        if step.load is not None and self._swap is None:
            if step.evict is not None:
                self.loaded.remove(step.evict)
            self._swap = asyncio.ensure_future(self._load(step.load, step.evict))
        self._arm_timer()

    def _touch(self, model: str) -> None:
        self.loaded.remove(model)
        self.loaded.append(model)

    def _arm_timer(self) -> None:
        """Grouped: wake when the oldest waiting request of an unloaded model becomes overdue."""
        pending = [w.waiting.arrived for w in self._waiters if w.waiting.model not in self.loaded]
        if self.scheduling is ModelScheduling.GROUPED and pending:
            delay = max(0.0, min(pending) + self.max_wait_s - self.clock()) + 0.001
            self._timer = asyncio.get_running_loop().call_later(delay, self._pump)

    async def _load(self, model: str, evict: str | None) -> None:
        try:
            if evict is not None:
                await self.loaders[evict].unload()
            await self.loaders[model].load()
            self.loads[model] += 1
            self.loaded.append(model)
        except Exception as exc:  # noqa: BLE001 - a failed load fails its waiting requests, nothing else
            log.warning("loading model %s failed: %s", model, exc)
            for w in [w for w in self._waiters if w.waiting.model == model]:
                self._waiters.remove(w)
                w.admitted.set_exception(exc)
        finally:
            self._swap = None
            self._pump()
