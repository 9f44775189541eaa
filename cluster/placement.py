"""CPU threads and core pinning for engines and workers.

A worker computes with `num_threads` torch threads. Left unset:
- a single engine (`splitserve generate`, `LLMEngine` in a script) uses every core this process
  may run on (its affinity, not the machine's core count: containers and taskset narrow it);
- the workers of a local cluster share this node's cores: one core is left to the router,
  frontends and Ray, and the rest is split evenly, each worker pinned to its own cores so two
  workers' OpenMP teams never preempt each other. 2 cores: one thread per worker (colocated: one
  worker on core 1, the router on core 0). 64 cores, 1 prefill + 1 decode: 31 threads each;
- a worker of a multi-node Ray cluster uses its actor's Ray CPUs (`worker_cpus`), unpinned: Ray
  places actors, and the operator sizes them.
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


def local_worker_shares(num_workers: int, num_threads: int | None, cpus: list[int] | None = None) -> list[CpuShare]:
    """Threads and cores for `num_workers` workers on this node. With num_threads set, every
    worker gets that many, pinned only where the node has a core of its own for each."""
    cpus = usable_cpus() if cpus is None else cpus
    spare = cpus[1:] if len(cpus) > 1 else cpus           # the first core: router, frontends, Ray
    threads = num_threads or max(1, len(spare) // num_workers)
    if threads * num_workers > len(spare):
        return [CpuShare(threads, None)] * num_workers
    return [CpuShare(threads, tuple(spare[i * threads:(i + 1) * threads])) for i in range(num_workers)]


def pin_process(cpus: tuple[int, ...]) -> None:
    """Pin every thread of this process (sched_setaffinity acts on one thread; threads started
    later inherit their creator's mask)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:   # a thread that ended meanwhile
            pass
    log.info("pinned to cores %s", ",".join(map(str, cpus)))
