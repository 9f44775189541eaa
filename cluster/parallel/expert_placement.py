"""Where each expert of a sparse layer lives under expert parallelism, and the balancer's rule for
changing it from measured load (pure functions: no torch, no process group).

A layer has E logical experts and S = E + R physical slots (R = `--num-redundant-experts`), split
over the ranks as evenly as they divide. A hot expert gets more than one slot (its replicas, on
different ranks); a token's pair with expert e runs on replica `token % replicas(e)`, so every
pair runs exactly once and the split does not depend on timing.

Two rules, as DeepSeek's EPLB recommends: `global` (decode: replicate the hottest experts, then
pack all replicas over all ranks, heaviest first onto the least-loaded rank) and `hierarchical`
(prefill: first expert groups packed onto nodes by load, keeping a group's traffic inside a node,
then the global rule within each node). Each role balances from its own measured load: a prefill
worker's load (long prompts) is not a decode worker's.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class BalancePolicy(Enum):
    GLOBAL = "global"
    HIERARCHICAL = "hierarchical"


@dataclass(frozen=True)
class LayerPlacement:
    """`ranks[r]`: the logical expert in each of rank r's slots, ascending."""
    ranks: tuple[tuple[int, ...], ...]

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def num_slots(self) -> int:
        return sum(len(r) for r in self.ranks)

    def replicas(self, num_experts: int) -> list[list[tuple[int, int]]]:
        """For each expert, its (rank, local slot) replicas in rank order."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(num_experts)]
        for rank, slots in enumerate(self.ranks):
            for local, expert in enumerate(slots):
                out[expert].append((rank, local))
        return out


def _split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def contiguous_placement(num_experts: int, world: int, redundant: int = 0) -> LayerPlacement:
    """The placement before any load is known: experts [r*E/N, (r+1)*E/N) on rank r (what EP
    without a balancer does), the redundant slots given to experts 0, 1, ... on other ranks."""
    experts = iter(range(num_experts))
    ranks = [[next(experts) for _ in range(n)] for n in _split(num_experts, world)]
    capacity = _split(num_experts + redundant, world)
    expert = 0
    for r in range(world):
        while len(ranks[r]) < capacity[r]:
            candidates = [e for e in range(num_experts) if e not in ranks[r]]
            pick = next((e for e in candidates if e >= expert), candidates[0] if candidates else expert % num_experts)
            ranks[r].append(pick)
            expert = pick + 1
    return LayerPlacement(tuple(tuple(sorted(r)) for r in ranks))


def _replica_counts(load: list[float], slots: int, max_replicas: int) -> list[int]:
    """One replica each, then each spare slot to the expert with the most load per replica."""
    counts = [1] * len(load)
    for _ in range(slots - len(load)):
        candidates = [e for e in range(len(load)) if counts[e] < max_replicas]
        if not candidates:
            break
        best = max(candidates, key=lambda e: (load[e] / counts[e], -e))
        counts[best] += 1
    return counts


def _pack(experts: list[int], load: list[float], counts: list[int], capacity: list[int]) -> list[list[int]]:
    """Replicas, heaviest first, each onto the least-loaded rank with a free slot that holds no
    replica of the same expert yet (any rank with a free slot if none is left)."""
    items = sorted(((load[e] / counts[e], e) for e in experts for _ in range(counts[e])), key=lambda x: (-x[0], x[1]))
    ranks: list[list[int]] = [[] for _ in capacity]
    weight = [0.0] * len(capacity)
    for share, e in items:
        free = [r for r in range(len(capacity)) if len(ranks[r]) < capacity[r]]
        distinct = [r for r in free if e not in ranks[r]] or free
        r = min(distinct, key=lambda r: (weight[r], r))
        ranks[r].append(e)
        weight[r] += share
    return ranks


def balance_global(load: list[float], world: int, redundant: int) -> LayerPlacement:
    capacity = _split(len(load) + redundant, world)
    counts = _replica_counts(load, sum(capacity), world)
    ranks = _pack(list(range(len(load))), load, counts, capacity)
    return LayerPlacement(tuple(tuple(sorted(r)) for r in ranks))


def balance_hierarchical(load: list[float], world: int, redundant: int, nodes: int, groups: int) -> LayerPlacement:
    """Expert groups (contiguous, `groups` of them) packed onto `nodes` nodes by load, then the
    global rule inside each node over its ranks and its share of the slots."""
    if nodes <= 1 or groups % nodes or world % nodes or len(load) % groups:
        return balance_global(load, world, redundant)
    size = len(load) // groups
    group_load = [sum(load[g * size:(g + 1) * size]) for g in range(groups)]
    per_node = groups // nodes
    node_groups: list[list[int]] = [[] for _ in range(nodes)]
    node_weight = [0.0] * nodes
    for g in sorted(range(groups), key=lambda g: (-group_load[g], g)):
        n = min((n for n in range(nodes) if len(node_groups[n]) < per_node), key=lambda n: (node_weight[n], n))
        node_groups[n].append(g)
        node_weight[n] += group_load[g]
    ranks_per_node, capacity = world // nodes, _split(len(load) + redundant, world)
    ranks: list[list[int]] = []
    for n in range(nodes):
        experts = [e for g in sorted(node_groups[n]) for e in range(g * size, (g + 1) * size)]
        node_capacity = capacity[n * ranks_per_node:(n + 1) * ranks_per_node]
        sub = [load[e] for e in experts]
        counts = _replica_counts(sub, sum(node_capacity), ranks_per_node)
        packed = _pack(list(range(len(experts))), sub, counts, node_capacity)
        ranks.extend([experts[i] for i in r] for r in packed)
    return LayerPlacement(tuple(tuple(sorted(r)) for r in ranks))


def balance(load: list[float], world: int, redundant: int, policy: BalancePolicy, nodes: int = 1,
            groups: int = 1) -> LayerPlacement:
    if policy is BalancePolicy.HIERARCHICAL:
        return balance_hierarchical(load, world, redundant, nodes, groups)
    return balance_global(load, world, redundant)


def rank_loads(load: list[float], placement: LayerPlacement) -> list[float]:
    """Each rank's share of the load: an expert's split evenly over its replicas."""
    replicas = placement.replicas(len(load))
    out = [0.0] * placement.world
    for e, where in enumerate(replicas):
        for rank, _ in where:
            out[rank] += load[e] / len(where)
    return out


def imbalance(load: list[float], placement: LayerPlacement) -> float:
    """Max over mean of the ranks' loads (1.0: even; the step waits for the busiest rank)."""
    per_rank = rank_loads(load, placement)
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0
