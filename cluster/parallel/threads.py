"""How a node's cores are split among a tensor-parallel worker's ranks: each rank pinned to its
own cores where there is at least one a rank (no two OpenMP teams on one core); where ranks
outnumber cores, every rank unpinned with one thread, said in the banner (never a refusal)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCores:
    cpus: tuple[int, ...] | None   # the cores to pin to; None: unpinned
    threads: int
    note: str                      # what the banner says about the split


def rank_cores(cpus: tuple[int, ...], threads: int | None, rank: int, world: int) -> RankCores:
    """Rank `rank`'s share of `cpus` (the worker's cores) and of `threads` (its thread budget)."""
    if len(cpus) < world:
        return RankCores(None, 1, f"{world} ranks on {len(cpus)} cores: unpinned, 1 thread each")
    per = len(cpus) // world
    share = tuple(cpus[rank * per:(rank + 1) * per])
    budget = max(1, (threads or len(cpus)) // world)
    return RankCores(share, min(budget, per), f"{world} ranks, {per} cores each (pinned)")
