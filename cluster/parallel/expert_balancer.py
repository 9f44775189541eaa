"""The expert balancer of an expert-parallel worker (`--enable-eplb`): rank 0 looks at the experts'
measured load every `--eplb-step-interval` passes, and where a new placement (expert_placement.py,
this worker's role's rule) cuts the busiest rank's share enough, it broadcasts the placement as a
step message and every rank moves the expert weights it lacks from a rank that holds them.

It runs between two passes on the engine's thread, so no request waits for more than the move and
none is dropped: the next pass routes by the new placement.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from cluster.eplb_config import ExpertBalanceConfig
from cluster.parallel.expert_placement import BalancePolicy, LayerPlacement, balance, rank_loads
from cluster.parallel.group import RankGroup
from cluster.parallel.moe_sharding import LocalExperts
from cluster.parallel.step_message import StepSender, control_message

log = logging.getLogger(__name__)


def placed_experts(model: nn.Module) -> list[LocalExperts]:
    """The model's expert-parallel layers, in module order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, LocalExperts)]


def exchange(group: RankGroup, experts: LocalExperts, new: LayerPlacement) -> None:
    """This rank's slots of `new` filled (from its own old slots where it held the expert, else
    received from the lowest rank that held it), then its routing switched to `new`. Every rank
    calls it with the same placement: each move is one send and one receive, in an order all
    ranks share (destination rank, then slot), so the moves cannot deadlock."""
    old, me = experts.placement, group.rank
    holder: dict[int, tuple[int, int]] = {}
    for rank, slots in enumerate(old.ranks):
        for slot, e in enumerate(slots):
            holder.setdefault(e, (rank, slot))
    gate_up = experts.gate_up.data.new_empty((len(new.ranks[me]), *experts.gate_up.shape[1:]))
    down = experts.down.data.new_empty((len(new.ranks[me]), *experts.down.shape[1:]))
    for dst, slots in enumerate(new.ranks):
        held = {e: slot for slot, e in enumerate(old.ranks[dst])}
        for slot, e in enumerate(slots):
            if e in held:
                if dst == me:
                    gate_up[slot].copy_(experts.gate_up.data[held[e]])
                    down[slot].copy_(experts.down.data[held[e]])
                continue
            src, src_slot = holder[e]
            if dst == me:
                group.recv(gate_up[slot], src)
                group.recv(down[slot], src)
            elif src == me:
                group.send(experts.gate_up.data[src_slot], dst)
                group.send(experts.down.data[src_slot], dst)
    experts.gate_up = nn.Parameter(gate_up, requires_grad=False)
    experts.down = nn.Parameter(down, requires_grad=False)
    experts.set_placement(new)


def apply_placements(group: RankGroup, layers: list[LocalExperts], placements) -> None:
    """Every layer whose placement changed moved to its new one (all ranks call it alike)."""
    for experts, ranks in zip(layers, placements, strict=True):
        new = LayerPlacement(tuple(tuple(r) for r in ranks))
        if new != experts.placement:
            exchange(group, experts, new)


@dataclass(frozen=True)
class Rebalance:
    """One look at the load: the busiest rank's share summed over layers, before and after."""
    step: int
    busiest_before: float
    busiest_after: float
    applied: bool


class ExpertBalancer:
    """Rank 0's side: counts passes, reads the load counters, decides, broadcasts and moves."""

    def __init__(self, config: ExpertBalanceConfig, group: RankGroup, sender: StepSender, model: nn.Module):
        self.config, self.group, self.sender = config, group, sender
        self.layers = placed_experts(model)
        self.policy = BalancePolicy(config.policy)
        self.steps = 0
        self.seen = [layer.token_counts() for layer in self.layers]   # counters at the last look
        self.history: list[Rebalance] = []

    @property
    def rebalances(self) -> int:
        return sum(r.applied for r in self.history)

    def between_steps(self) -> None:
        """Called before each pass: every `eplb_step_interval` passes, one look at the load."""
        self.steps += 1
        if self.layers and self.steps % self.config.eplb_step_interval == 0:
            self.look()

    def look(self) -> Rebalance:
        counts = [layer.token_counts() for layer in self.layers]
        loads = [[float(c - s) for c, s in zip(now, then)] for now, then in zip(counts, self.seen)]
        self.seen = counts
        new = [balance(load, self.group.world, self.config.num_redundant_experts, self.policy)
               for load in loads]
        before = sum(max(rank_loads(load, layer.placement)) for load, layer in zip(loads, self.layers))
        after = sum(max(rank_loads(load, p)) for load, p in zip(loads, new))
        applied = before > 0 and after <= before * (1 - self.config.eplb_min_gain)
        if applied:
            placement = tuple(p.ranks for p in new)
            self.sender.send(control_message(self.group.device, "experts", placement=placement))
            apply_placements(self.group, self.layers, placement)
            log.info("experts rebalanced at pass %d: busiest rank's load %.0f -> %.0f (%s rule)",
                     self.steps, before, after, self.policy.value)
        record = Rebalance(self.steps, before, after, applied)
        self.history.append(record)
        return record


def rank_token_counts(model: nn.Module) -> list[tuple[int, tuple[int, ...]]]:
    """Each expert-parallel layer's (layer, pairs run on each rank) since the model was built."""
    return [(layer.layer, tuple(int(x) for x in layer.rank_tokens.tolist())) for layer in placed_experts(model)]
