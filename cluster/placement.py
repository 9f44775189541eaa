"""CPU threads and core pinning for engines and workers.

A worker computes with `num_threads` torch threads. Left unset:
- a single engine (`splitserve generate`, `LLMEngine` in a script) uses every core this process
  may run on (its affinity, not the machine's core count: containers and taskset narrow it);
- the workers of a local cluster split this node's cores evenly between them, each pinned to its
  own cores so two workers' OpenMP teams never preempt each other. The router, frontends and Ray
  are not pinned: their share is small (docs/benchmarks.md, "Throughput on a CPU without AVX-512"), so on a node of fewer
  than ROUTER_CORE_MIN_CPUS cores no core is held back for them, where it would be a large share
  of the compute (half of it on 2 cores). From ROUTER_CORE_MIN_CPUS cores on, one core is left to
  them (a few percent of the compute), which keeps their bursts off the workers' OpenMP teams.
  2 cores: colocated, one worker with 2 threads on cores 0-1; 1P1D, one thread each on core 0
  and core 1. 64 cores, 1 prefill + 1 decode: 31 threads each, on cores 1-31 and 32-62;
- a worker of a multi-node Ray cluster uses its actor's Ray CPUs (`worker_cpus`), unpinned: Ray
  places actors, and the operator sizes them.

Workers sharing cores with the router wait passively between parallel regions (`worker_env`:
OpenMP's PASSIVE wait policy), so a worker's idle OpenMP threads never spin on a core the router
needs, and an idle cluster spins nothing.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from cluster.model.kernel_plan import KernelPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuShare:
    threads: int
    cpus: tuple[int, ...] | None    # cores to pin the worker's process to; None: not pinned


@dataclass(frozen=True)
class ComputeSetup:
    """What an engine computes with: reported by every worker, so a test or an operator can see
    that all workers of a cluster run one kernel plan."""
    plan: KernelPlan
    threads: int
    cpus: tuple[int, ...] | None


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


# From this many cores on, a local cluster keeps one core for the router, frontends and Ray.
ROUTER_CORE_MIN_CPUS = 16

# OpenMP settings of a worker process (the environment's own values win): PASSIVE wait, so
# threads between parallel regions sleep instead of spinning on cores the router shares.
WORKER_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def local_worker_shares(num_workers: int, num_threads: int | None, cpus: list[int] | None = None) -> list[CpuShare]:
    """Threads and cores for `num_workers` workers on this node. With num_threads set, every
    worker gets that many, pinned only where the node has a core of its own for each."""
    cpus = usable_cpus() if cpus is None else cpus
    spare = cpus[1:] if len(cpus) >= ROUTER_CORE_MIN_CPUS else cpus
    threads = num_threads or max(1, len(spare) // num_workers)
    if threads * num_workers > len(spare):
        return [CpuShare(threads, None)] * num_workers
    return [CpuShare(threads, tuple(spare[i * threads:(i + 1) * threads])) for i in range(num_workers)]


def worker_env(share: CpuShare) -> dict[str, str]:
    """Environment variables of a worker process: its OpenMP team's size and wait policy."""
    env = {"OMP_NUM_THREADS": str(share.threads)}
    env.update({k: os.environ.get(k, v) for k, v in WORKER_OMP_ENV.items()})
    return env


def pin_process(cpus: tuple[int, ...]) -> None:
    """Pin every thread of this process (sched_setaffinity acts on one thread; threads started
    later inherit their creator's mask)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:   # a thread that ended meanwhile
            pass
    log.info("pinned to cores %s", ",".join(map(str, cpus)))
