"""A discrete-event simulator of a splitserve cluster: the router's routing policy (router/policy.py's
policy and its `WorkerView`, injected: the core imports no role) over `SimWorker`s whose step costs come from a `DeviceProfile`, and the planner's rule
deciding every interval from the same `MetricsSnapshot` the live cluster gives it.

What it models: prefill queues and passes, KV transfer to the decode worker (bytes over the
profile's bandwidth), decode batches stepping together, KV capacity, the workers' prefix caches,
a new worker's start (`worker_start_s`), a role switch (`switch_s`), and drains that move a
leaving worker's sequences to peers (their KV over the transfer bandwidth). What it leaves out:
network jitter, the router's own CPU, preemption. Past `candidates` workers of a role the policy
scores a random sample of that many (power of k choices), as a large router would.
"""
from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

from cluster.planner.costs import DeviceProfile
from cluster.planner.loop import apply
from cluster.planner.sim_metrics import SimResult, Window, summarize
from cluster.planner.sim_workers import SimRequest, SimWorker, WorkerState
from cluster.planner.snapshot import DECODE, PREFILL
from cluster.planner.traces import TraceRequest


@dataclass(frozen=True)
class SimConfig:
    prefill: int
    decode: int
    ttft_slo_s: float
    itl_slo_s: float
    colocated: bool = False
    planner_interval_s: float = 5.0
    candidates: int = 64
    closed_loop: int | None = None     # this many streams back to back (the trace's arrival times ignored)
    max_time_s: float | None = None    # stop here even with requests left (default: trace end x 3 + 60 s)
    seed: int = 0


class Simulator:
    """One run: `Simulator(costs, cfg, policy, make_view, rule).run(trace)`: `policy` chooses
    workers as the router's does, over views `make_view(name, role)` makes (router/policy.py's
    `WorkerView`). It is also the planner's `Actuator` (add, remove, switch) over its own workers."""

    def __init__(self, costs: DeviceProfile, cfg: SimConfig, policy, make_view, rule=None):
        self.costs, self.cfg, self.policy, self.rule = costs, cfg, policy, rule
        self.make_view = make_view
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.rng = random.Random(cfg.seed)
        self.workers: dict[str, SimWorker] = {}
        self.views: dict = {}                           # worker name -> its view (the policy reads it)
        self.names = {PREFILL: itertools.count(), DECODE: itertools.count()}   # a name per role, kept on a switch
        self.after_drain: dict[str, str | None] = {}    # draining worker -> its next role (None: leaving)
        self.switching: dict[str, str] = {}             # drained worker -> the role it is switching to
        self.window = Window()
        self.requests: list[SimRequest] = []
        self.completed = 0
        self.request_ids = itertools.count()
        self._feed = iter(())                            # a closed loop's requests still to send
        self.worker_seconds = 0.0
        self.actions = 0
        self._serving_cache: dict[str, list[SimWorker]] | None = None
        first_role = "both" if cfg.colocated else PREFILL
        for _ in range(0 if cfg.colocated else cfg.prefill):
            self._new_worker(first_role, WorkerState.SERVING)
        for _ in range(cfg.decode):
            self._new_worker("both" if cfg.colocated else DECODE, WorkerState.SERVING)

    # -- the event loop
    def _at(self, t: float, kind: str, obj=None, extra=None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj, extra))

    def run(self, trace: list[TraceRequest]) -> SimResult:
        self._feed = iter(trace)
        if self.cfg.closed_loop:
            for _ in range(self.cfg.closed_loop):
                self._next_closed_loop()
        else:
            for tr in trace:
                self._at(tr.arrival_s, "arrive", SimRequest(next(self.request_ids), tr, tr.arrival_s))
        end = trace[-1].arrival_s if trace and not self.cfg.closed_loop else 0.0
        limit = self.cfg.max_time_s or end * 3 + 60
        self._at(self.cfg.planner_interval_s, "tick")
        handlers = {"arrive": self._arrive, "step": self._step_done, "ready": self._ready,
                    "transfer": self._transfer_done, "tick": self._tick, "switched": self._switched}
        while self.events:
            t, _, kind, obj, extra = heapq.heappop(self.events)
            if t > limit or (kind == "tick" and self.completed >= len(trace)):
                break
            self.now = t
            handlers[kind](obj, extra)
        return summarize(self.requests, len(trace), self.cfg.ttft_slo_s, self.cfg.itl_slo_s,
                         self.worker_seconds / max(self.now, 1e-9), self.actions, self.now)

    def _next_closed_loop(self) -> None:
        tr = next(self._feed, None)
        if tr is not None:
            self._at(self.now, "arrive", SimRequest(next(self.request_ids), tr, self.now))

    # -- workers
    def _new_worker(self, role: str, state: WorkerState) -> SimWorker:
        kind = DECODE if role == "both" else role
        w = SimWorker(f"{kind}-{next(self.names[kind])}", role, self.costs, state)
        self.workers[w.name] = w
        self.views[w.name] = self.make_view(w.name, role)
        self.views[w.name].blocks_total = 1000
        self._serving_cache = None
        return w

    def _serving(self, role: str) -> list[SimWorker]:
        if self._serving_cache is None:
            cache: dict[str, list[SimWorker]] = {PREFILL: [], DECODE: [], "both": []}
            for w in self.workers.values():
                if w.state is WorkerState.SERVING:
                    cache[w.role].append(w)
            self._serving_cache = cache
        return self._serving_cache[role]

    def _pick(self, role: str, blocks, choose) -> SimWorker | None:
        pool = self._serving(role)
        if not pool:
            return None
        if len(pool) > self.cfg.candidates:
            pool = self.rng.sample(pool, self.cfg.candidates)
        views = []
        for w in pool:
            v = self.views[w.name]
            v.in_flight, v.running = w.load(), len(w.running)
            v.blocks_free = int(1000 * w.kv_free_share())
            views.append(v)
        chosen = choose(list(blocks), views)
        chosen.remember(list(blocks))
        return self.workers[chosen.name]

    def _kick(self, w: SimWorker) -> None:
        if w.busy or w.state not in (WorkerState.SERVING, WorkerState.DRAINING):
            return
        duration = w.start_step()
        if duration is not None:
            self._at(self.now + duration, "step", w, duration)

    # -- requests
    def _arrive(self, req: SimRequest, _=None) -> None:
        self.requests.append(req)
        self._route_prompt(req)
        self.window.arrived(req)

    def _route_prompt(self, req: SimRequest) -> None:
        role = "both" if self.cfg.colocated else PREFILL
        w = self._pick(role, req.trace.blocks, self.policy.choose_prefill)
        if w is None:      # no worker of the role serving (all starting or switching): wait for one
            self._at(self.now + 0.1, "transfer", req, None)
            return
        req.prefilled = 0
        w.take_prompt(req)
        self._kick(w)

    def _route_sequence(self, req: SimRequest, transfer_tokens: int) -> None:
        w = self._pick(DECODE, req.trace.blocks, self.policy.choose_decode)
        delay = self.costs.transfer_time(transfer_tokens)
        self._at(self.now + max(delay, 1e-6) if w else self.now + 0.1, "transfer", req, w)

    def _transfer_done(self, req: SimRequest, w: SimWorker | None) -> None:
        if req.first_token_s is None:       # a prompt that found no worker: try again
            return self._route_prompt(req)
        if w is None or w.state is not WorkerState.SERVING:
            return self._route_sequence(req, 0 if w is None else req.context)
        w.take_sequence(req)
        self._kick(w)

    def _step_done(self, w: SimWorker, duration: float) -> None:
        first, done = w.finish_step(self.now, duration)
        for req in first:
            self.window.first_token(req)
            if w.role != PREFILL:       # a colocated worker's prompt joined its own batch (which finishes it)
                continue
            if req.remaining <= 0:
                self._finish(req)
            else:
                self._route_sequence(req, req.trace.input_tokens)
        for req in done:
            self._finish(req)
        if w.state is WorkerState.DRAINING:
            self._drain(w)
        else:
            self._kick(w)

    def _finish(self, req: SimRequest) -> None:
        req.done_s = self.now
        self.completed += 1
        self.window.finished(req)
        if self.cfg.closed_loop:
            self._next_closed_loop()

    # -- the planner and its actuator
    def _tick(self, _=None, __=None) -> None:
        alive = sum(w.state is not WorkerState.GONE for w in self.workers.values())
        self.worker_seconds += alive * self.cfg.planner_interval_s
        if self.rule is not None:
            pending = [r for r in self.after_drain.values() if r] + list(self.switching.values())
            snap = self.window.snapshot(self.now, self.cfg.planner_interval_s, self.workers.values(), pending)
            actions = self.rule(snap)
            self.actions += len(actions)
            apply(actions, self, log_each=False)
        self.window = Window()
        self._at(self.now + self.cfg.planner_interval_s, "tick")

    def add(self, role: str) -> None:
        w = self._new_worker(role, WorkerState.STARTING)
        self._at(self.now + self.costs.worker_start_s, "ready", w)

    def _ready(self, w: SimWorker, _=None) -> None:
        w.state = WorkerState.SERVING
        self._serving_cache = None

    def remove(self, name: str) -> None:
        self._start_drain(name, None)

    def switch(self, name: str, to: str) -> None:
        self._start_drain(name, to)

    def _start_drain(self, name: str, next_role: str | None) -> None:
        w = self.workers.get(name)
        if w is None or w.state is not WorkerState.SERVING:
            return
        w.state = WorkerState.DRAINING
        self._serving_cache = None
        self.after_drain[name] = next_role
        if not w.busy:
            self._drain(w)

    def _drain(self, w: SimWorker) -> None:
        """Hand everything the worker holds to peers: prompts re-routed, sequences' KV moved."""
        for req in w.evict_all():
            if req.first_token_s is None:
                self._route_prompt(req)
            else:
                self._route_sequence(req, req.context)
        next_role = self.after_drain.pop(w.name, None)
        w.state = WorkerState.GONE
        self._serving_cache = None
        if next_role is not None:
            self.switching[w.name] = next_role
            self._at(self.now + self.costs.switch_s, "switched", w, next_role)

    def _switched(self, w: SimWorker, role: str) -> None:
        self.switching.pop(w.name, None)
        w.role, w.state = role, WorkerState.SERVING
        self.views[w.name].role = role
        self._serving_cache = None
