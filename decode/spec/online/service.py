"""The online trainer: a low-priority Ray actor that closes the loop (`--spec-online`).

Every `spec_online_interval_s` it takes each decode worker's samples and acceptance counts
(`DecodeWorker.spec_online_take`), keeps each tenant's recent traffic (bounded; in memory unless
`spec_online_dir` is set, and then only the promoted heads are written), and per tenant:
 - on probation (a head promoted one window ago): replays the window's traffic through the new head
   and the one before, and rolls back if the new one accepts less (policy.py);
 - else, once `spec_online_min_tokens` new tokens arrived: trains a candidate from the live head
   (trainer.py) on all but the newest fifth of the traffic, scores both on that newest fifth, and
   promotes the candidate if it wins: staged on every decode worker first, then activated on each
   (between two of its steps), so all serve the same version.
A worker that restarted (a new incarnation) comes back on the base head: it gets every tenant's
live version again. A trainer that restarted resumes, per tenant, the newest version saved in
`spec_online_dir` that held up over its window (same target weights, same base head), else the
base head. Training runs in a thread at the lowest CPU priority, one torch thread.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cluster.config import EngineConfig
from cluster.worker_messages import CONTROL
from decode.spec.online.messages import BASE_VERSION, HeadUpdate, OnlineReport, ServedSample, pack_tensors
from decode.spec.online.store import HeadStore
from decode.spec.online.policy import Phase, TenantPolicy, Verdict
from decode.spec.online.trainer import HeadTrainer

log = logging.getLogger(__name__)
HOLDOUT = 0.2          # the newest share of a tenant's traffic: scored on, never trained on
MIN_HOLDOUT_TOKENS = 256   # fewer held-out tokens make a 2% margin noise: no round until there are more
CALL_S = 30.0          # a decode worker's answer to a control call (a staged head builds in well under this)


@dataclass(frozen=True)
class OnlineEvent:
    """One decision, for the status (tests, benchmarks, logs)."""
    at: float
    tenant: str
    kind: str             # "promoted" | "kept" | "rolled_back" | "declined"
    version: int
    score: float          # the head's score (held-out, or on the window's traffic)
    other: float          # the head it was compared with


@dataclass(frozen=True)
class OnlineStatus:
    live: tuple[tuple[str, int], ...]             # (tenant, live version)
    events: tuple[OnlineEvent, ...]
    buffered_tokens: tuple[tuple[str, int], ...]  # (tenant, tokens held here)


@dataclass
class _Tenant:
    policy: TenantPolicy
    samples: deque = field(default_factory=deque)     # ServedSample, oldest first
    tokens: int = 0
    fresh: int = 0                                    # tokens since the last round
    window: list = field(default_factory=list)        # samples served while on probation
    versions: dict = field(default_factory=dict)      # version -> trainable tensors (live and previous)
    next_version: int = BASE_VERSION + 1


class OnlineTrainerService:
    def __init__(self, engine: EngineConfig, workers: dict, model_dir: Path, head_dir: Path, fingerprint: str):
        """`workers`: decode worker name -> its actor handle."""
        os.nice(19)                      # serving comes first: this only uses what is left
        torch.set_num_threads(1)
        self.spec = engine.speculative
        self.workers = dict(workers)
        self.fingerprint, self.base_head = fingerprint, head_dir.name
        self.trainer = HeadTrainer(head_dir, model_dir)
        self.tenants: dict[str, _Tenant] = {}
        self.incarnations: dict[str, str] = {}
        self.events: list[OnlineEvent] = []
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()      # one decision at a time: a round, a rollback, a drill's promotion
        self.store = HeadStore(self.spec.spec_online_dir, fingerprint, self.base_head)
        self._restore()
        try:        # as a Ray async actor (a restarted one too), its loop runs already: start polling
            self._task = asyncio.get_running_loop().create_task(self._run())
        except RuntimeError:     # no loop (a plain object): `start` does it
            pass

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the loop outlives one bad round; serving never depends on it
                log.exception("online adaptation round failed")
            await asyncio.sleep(self.spec.spec_online_interval_s)

    def _tenant(self, name: str) -> _Tenant:
        if name not in self.tenants:
            self.tenants[name] = _Tenant(TenantPolicy(self.spec.spec_online_window),
                                         versions={BASE_VERSION: self.trainer.base})
        return self.tenants[name]

    async def _call(self, name: str, method: str, *args):
        handle = self.workers[name]
        return await asyncio.wait_for(getattr(handle, method).options(concurrency_group=CONTROL).remote(*args),
                                      CALL_S)

    async def poll_once(self) -> None:
        async with self._lock:
            await self._poll()

    async def _poll(self) -> None:
        names = list(self.workers)
        reports = await asyncio.gather(*(self._call(n, "spec_online_take") for n in names), return_exceptions=True)
        for name, report in zip(names, reports):
            if isinstance(report, OnlineReport):
                await self._absorb(name, report)
        for tenant_name in list(self.tenants):
            await self._decide(tenant_name)

    async def _absorb(self, name: str, report: OnlineReport) -> None:
        if self.incarnations.get(name) != report.incarnation:
            self.incarnations[name] = report.incarnation
            await self._resync(name, report)
        for sample in report.samples:
            self._keep(sample)
        by_tenant: dict[str, list] = {}
        for count in report.acceptance:
            if not self.spec.online_tenant(count.tenant):
                continue
            by_tenant.setdefault(count.tenant, []).append(count)
        for tenant_name, counts in by_tenant.items():
            self._tenant(tenant_name).policy.observe(counts)

    def _keep(self, sample: ServedSample) -> None:
        t = self._tenant(sample.tenant)
        t.samples.append(sample)
        t.tokens += len(sample.tokens)
        t.fresh += len(sample.tokens)
        if t.policy.phase is Phase.PROBATION:
            t.window.append(sample)
        while t.tokens > self.spec.spec_online_buffer_tokens and len(t.samples) > 1:
            t.tokens -= len(t.samples.popleft().tokens)

    async def _resync(self, name: str, report: OnlineReport) -> None:
        """A worker new to this trainer (or restarted): every tenant's live version. A version the
        worker serves that this trainer does not know (the trainer restarted, its state lost) goes
        back to the base head, and new versions are numbered past it."""
        live = {h.tenant: h.version for h in report.live}
        for tenant_name, version in live.items():
            if self.spec.online_tenant(tenant_name):
                t = self._tenant(tenant_name)
                t.next_version = max(t.next_version, version + 1)
        for tenant_name, t in self.tenants.items():
            if t.policy.live != live.get(tenant_name, BASE_VERSION):
                await self._push(tenant_name, t, t.policy.live, [name])

    async def _decide(self, tenant_name: str) -> None:
        t = self.tenants[tenant_name]
        policy = t.policy
        if policy.window_full() and t.window:
            new, old = policy.live, policy.previous
            scores = await asyncio.to_thread(self._compare, t.versions[new], t.versions[old], list(t.window))
            verdict = policy.judge(*scores)
            t.window = []
            if verdict is Verdict.ROLLBACK:
                await self._push(tenant_name, t, old, list(self.workers), rollback=True)
                t.versions.pop(new, None)
                self._event(tenant_name, "rolled_back", new, *scores)
                self.store.mark(tenant_name, new, "rolled_back")
            else:
                t.versions = {v: x for v, x in t.versions.items() if v in (BASE_VERSION, new)}
                self._event(tenant_name, "kept", new, *scores)
                self.store.mark(tenant_name, new, "kept")
            return
        if policy.phase is Phase.SERVING and t.fresh >= self.spec.spec_online_min_tokens \
                and t.tokens * HOLDOUT >= MIN_HOLDOUT_TOKENS:
            t.fresh = 0
            await self._round(tenant_name, t)

    def _compare(self, a: dict, b: dict, samples: list[ServedSample]) -> tuple[float, float]:
        return self.trainer.compare(a, b, samples)[:2]

    async def _round(self, tenant_name: str, t: _Tenant) -> None:
        samples = list(t.samples)
        cut = max(1, int(len(samples) * (1 - HOLDOUT)))
        train, holdout = samples[:cut], samples[cut:]
        if not holdout:
            return
        live = t.versions[t.policy.live]
        candidate = await asyncio.to_thread(self.trainer.train, live, train, self.spec.spec_online_steps)
        cand_score, live_score, noise = await asyncio.to_thread(self.trainer.compare, candidate, live, holdout)
        version = t.next_version
        if not t.policy.promotes(cand_score, live_score, noise):
            self._event(tenant_name, "declined", version, cand_score, live_score)
            return
        await self._promote(tenant_name, candidate, scores=(cand_score, live_score))

    async def _promote(self, tenant_name: str, tensors: dict, scores: tuple[float, float] = (0.0, 0.0)) -> int:
        """`tensors` becomes the tenant's next version on every decode worker, on probation."""
        t = self._tenant(tenant_name)
        version = t.next_version
        t.next_version += 1
        t.versions[version] = tensors
        await self._push(tenant_name, t, version, list(self.workers))
        t.policy.promoted(version)
        t.window = []
        self._event(tenant_name, "promoted", version, *scores)
        self.store.save(tenant_name, version, tensors)
        return version

    async def _push(self, tenant_name: str, t: _Tenant, version: int, names: list[str], rollback: bool = False) -> None:
        """Stage `version` on every worker of `names` first, then activate it on each."""
        if version != BASE_VERSION:
            update = HeadUpdate(tenant_name, version, self.fingerprint, self.base_head,
                                pack_tensors(t.versions[version]))
            staged = await asyncio.gather(*(self._call(n, "spec_head_stage", update) for n in names),
                                          return_exceptions=True)
            for n, result in zip(names, staged):
                if isinstance(result, BaseException):   # restarting: its resync brings it up to date
                    log.warning("online head v%d for tenant %r not staged on %s: %s", version, tenant_name, n, result)
            names = [n for n, result in zip(names, staged) if not isinstance(result, BaseException)]
        await asyncio.gather(*(self._call(n, "spec_head_activate", tenant_name, version, rollback) for n in names),
                             return_exceptions=True)

    def _event(self, tenant: str, kind: str, version: int, score: float, other: float) -> None:
        self.events.append(OnlineEvent(time.time(), tenant, kind, version, score, other))
        log.info("online head of tenant %r: %s v%d (%.3f vs %.3f)", tenant, kind, version, score, other)

    def _restore(self) -> None:
        """After a restart: per opted-in tenant, the newest saved version that was kept."""
        for resumed in self.store.resume(self.trainer.names, self.spec.online_tenant):
            t = self._tenant(resumed.tenant)
            t.next_version = max(t.next_version, resumed.next_version)
            if resumed.version is not None:
                t.versions[resumed.version] = resumed.tensors
                t.policy.live = resumed.version
                log.info("online head of tenant %r: resumed v%d", resumed.tenant, resumed.version)

    # --- for tests, benchmarks and drills ---------------------------------------------------------
    async def status(self) -> OnlineStatus:
        return OnlineStatus(tuple((n, t.policy.live) for n, t in sorted(self.tenants.items())), tuple(self.events),
                            tuple((n, t.tokens) for n, t in sorted(self.tenants.items())))

    async def inject_degraded(self, tenant_name: str, noise: float, seed: int = 0) -> int:
        """Fault drill: promote the live head plus noise, skipping the held-out check (the rollback
        guard must catch it within one window)."""
        gen = torch.Generator().manual_seed(seed)
        async with self._lock:
            t = self._tenant(tenant_name)
            bad = {k: v + noise * v.std() * torch.randn(v.shape, generator=gen)
                   for k, v in t.versions[t.policy.live].items()}
            return await self._promote(tenant_name, bad)
