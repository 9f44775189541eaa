"""The expert balancer's placement rules (cluster/parallel/expert_placement.py): every slot filled,
every expert placed, replicas of one expert on different ranks, the hot experts replicated, and
the busiest rank's share of a skewed load cut."""
from __future__ import annotations

import random

import pytest

from cluster.eplb_config import ExpertBalanceConfig
from cluster.parallel.expert_placement import (BalancePolicy, balance, contiguous_placement, imbalance,
                                               rank_loads)


def _check_valid(placement, num_experts: int, world: int, redundant: int) -> None:
    assert placement.world == world and placement.num_slots == num_experts + redundant
    sizes = [len(r) for r in placement.ranks]
    assert max(sizes) - min(sizes) <= 1
    replicas = placement.replicas(num_experts)
    assert all(replicas), "every expert has a slot"
    for where in replicas:
        ranks = [r for r, _ in where]
        assert len(set(ranks)) == len(ranks), "no rank holds an expert twice"


@pytest.mark.parametrize(("experts", "world", "redundant"), [(8, 2, 0), (8, 2, 2), (64, 4, 8), (10, 3, 2)])
def test_contiguous_placement_is_what_plain_expert_parallelism_does(experts, world, redundant):
    p = contiguous_placement(experts, world, redundant)
    _check_valid(p, experts, world, redundant)
    if redundant == 0:
        flat = [e for r in p.ranks for e in r]
        assert flat == list(range(experts))


def test_a_skewed_load_is_spread_by_replicating_the_hot_experts():
    load = [400.0, 300, 10, 10, 10, 10, 10, 10]          # two hot experts, both in rank 0's half
    before = contiguous_placement(8, 2, 0)
    after = balance(load, 2, 2, BalancePolicy.GLOBAL)
    _check_valid(after, 8, 2, 2)
    replicas = after.replicas(8)
    assert len(replicas[0]) == 2 and len(replicas[1]) == 2   # the two hottest got the spare slots
    assert imbalance(load, after) < 1.02 < imbalance(load, before)
    assert sum(rank_loads(load, after)) == pytest.approx(sum(load))


def test_random_skewed_loads_never_get_worse_than_contiguous():
    rng = random.Random(7)
    for _ in range(50):
        experts, world = rng.choice([(8, 2), (16, 4), (64, 8)])
        redundant = rng.choice([0, world, 2 * world])
        load = [rng.paretovariate(1.2) for _ in range(experts)]
        after = balance(load, world, redundant, BalancePolicy.GLOBAL)
        _check_valid(after, experts, world, redundant)
        assert imbalance(load, after) <= imbalance(load, contiguous_placement(experts, world, 0)) + 1e-9


def test_hierarchical_keeps_each_group_on_one_node():
    # 4 groups of 4 experts, 2 nodes of 2 ranks: a group's experts stay inside one node.
    load = [float(x) for x in [50, 1, 1, 1, 1, 1, 1, 1, 40, 1, 1, 1, 1, 1, 1, 1]]
    p = balance(load, 4, 4, BalancePolicy.HIERARCHICAL, nodes=2, groups=4)
    _check_valid(p, 16, 4, 4)
    node_of = {}
    for rank, slots in enumerate(p.ranks):
        for e in slots:
            node_of.setdefault(e // 4, set()).add(rank // 2)
    assert all(len(nodes) == 1 for nodes in node_of.values())
    # the two hot groups went to different nodes
    assert node_of[0] != node_of[2]
    assert imbalance(load, p) < imbalance(load, contiguous_placement(16, 4, 0))


def test_hierarchical_on_one_node_is_the_global_rule():
    load = [float(i * i) for i in range(8)]
    assert balance(load, 2, 2, BalancePolicy.HIERARCHICAL, nodes=1) == balance(load, 2, 2, BalancePolicy.GLOBAL)


def test_each_role_resolves_its_own_rule():
    assert ExpertBalanceConfig(role="prefill").policy == "hierarchical"
    assert ExpertBalanceConfig(role="decode").policy == "global"
    assert ExpertBalanceConfig(role="prefill", eplb_policy="global").policy == "global"
