"""A sparse (mixture-of-experts) layer over the ranks of a tensor-parallel group: the router
replicated, the experts either sliced (TP, the default: every expert's intermediate rows on every
rank, as the dense MLP's) or placed whole (EP, `--enable-expert-parallel`: each rank its share of
the experts, unevenly where they do not divide); Qwen2-MoE's shared expert sliced as a dense MLP.
The block's output is then one all-reduce of the ranks' partial sums, as a dense layer's.

With EP every rank sees every token (the attention's all-reduce left the hidden states the same
on all ranks): each computes its experts' share of each token (the routing weight of an expert
it does not hold is left out) and the all-reduce adds them. Tokens do not move (no all-to-all).
"""
from __future__ import annotations

import torch
from torch import nn

from cluster.model.moe import MoEExperts, SparseMoeBlock, moe_compute
from cluster.parallel.expert_placement import LayerPlacement, contiguous_placement
from cluster.parallel.group import RankGroup


class ReducedBlock(nn.Module):
    """A sharded sparse block and the all-reduce of its partial output."""

    geglu = False

    def __init__(self, inner: SparseMoeBlock, group: RankGroup):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor, fp) -> torch.Tensor:
        return self.group.all_reduce(self.inner.forward(x, fp))


class LocalExperts(MoEExperts):
    """This rank's slots of a layer's experts under expert parallelism: which logical expert each
    rank's slots hold is the layer's `LayerPlacement` (contiguous ranges, or the balancer's, with
    hot experts replicated). Routing ids stay global (the load counters count every expert); a
    pair with expert e runs on its replica `token % replicas(e)`, so each pair runs on exactly one
    rank; pairs whose replica is elsewhere do not run here."""

    def __init__(self, experts: MoEExperts, placement: LayerPlacement, rank: int):
        hidden = experts.gate_up.shape[2]
        super().__init__(0, hidden, experts.down.shape[2], experts.layer)   # no full-size scratch
        self.num_experts = experts.num_experts   # the load counters count every expert
        slots = list(placement.ranks[rank])
        self.gate_up = nn.Parameter(experts.gate_up.data[slots].clone(), requires_grad=False)
        self.down = nn.Parameter(experts.down.data[slots].clone(), requires_grad=False)
        self.rank, self.path = rank, experts.path
        # Pairs run on each rank since the model was built (counted on every rank: rank 0's is read).
        self.rank_tokens = torch.zeros(placement.world, dtype=torch.int64, device=self.gate_up.device)
        self.set_placement(placement)

    def set_placement(self, placement: LayerPlacement) -> None:
        """The routing tables of `placement` (the weights must already be its slots' on this rank)."""
        replicas = placement.replicas(self.num_experts)
        width = max(len(r) for r in replicas)
        owner = torch.zeros(self.num_experts, width, dtype=torch.int64)
        local = torch.zeros(self.num_experts, width, dtype=torch.int64)
        for e, where in enumerate(replicas):
            for j, (rank, slot) in enumerate(where):
                owner[e, j], local[e, j] = rank, slot
        device = self.gate_up.device
        self.placement = placement
        self.replica_count = torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=device)
        self.replica_rank, self.replica_slot = owner.to(device), local.to(device)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Only the (token, expert) pairs placed here run: one row each (k = 1), token by token in
        ascending expert order, added into their tokens' rows."""
        self._count_tokens(topk_ids)
        k, flat_ids = topk_ids.shape[1], topk_ids.reshape(-1)
        replica = (torch.arange(flat_ids.numel(), device=flat_ids.device) // k) % self.replica_count[flat_ids]
        owner = self.replica_rank[flat_ids, replica]
        self.rank_tokens.index_add_(0, owner, torch.ones_like(owner))
        pairs = (owner == self.rank).nonzero().squeeze(1)
        pairs = pairs[torch.argsort((pairs // k) * self.num_experts + flat_ids[pairs], stable=True)]
        out = torch.zeros_like(hidden)
        if pairs.numel() == 0:
            return out
        rows = pairs // k
        part = moe_compute(self.path, hidden.device)(
            hidden.index_select(0, rows), self.gate_up, self.down, self.replica_slot[flat_ids[pairs], replica[pairs]][:, None],
            topk_weights.reshape(-1)[pairs][:, None])
        return out.index_add_(0, rows, part)

    def _count_tokens(self, topk_ids: torch.Tensor) -> None:
        flat = topk_ids.reshape(-1)
        if self.tokens is None or self.tokens.device != flat.device:
            self.tokens = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        self.tokens.index_add_(0, flat, torch.ones_like(flat))


def _slice_rows(weight: torch.Tensor, inter: int, a: int, b: int) -> torch.Tensor:
    """Gate rows a:b and up rows a:b of a fused [.., 2I, H] weight."""
    return torch.cat([weight[..., a:b, :], weight[..., inter + a:inter + b, :]], dim=-2).contiguous()


def slice_experts(experts: MoEExperts, rank: int, world: int) -> None:
    inter = experts.down.shape[2]
    if inter % world:
        raise ValueError(f"expert intermediate size {inter} does not split over {world} tensor-parallel ranks "
                         "(--enable-expert-parallel places whole experts instead)")
    a, b = rank * (inter // world), (rank + 1) * (inter // world)
    experts.gate_up = nn.Parameter(_slice_rows(experts.gate_up.data, inter, a, b), requires_grad=False)
    experts.down = nn.Parameter(experts.down.data[..., a:b].contiguous(), requires_grad=False)


def slice_dense_mlp(mlp: nn.Module, rank: int, world: int) -> None:
    """A shared expert (an MLP of gate_up_proj and down_proj): its intermediate rows sliced; its
    partial output joins the block's, which the block's one all-reduce adds."""
    inter = mlp.down_proj.in_features
    if inter % world:
        raise ValueError(f"shared expert intermediate size {inter} does not split over {world} ranks")
    a, b = rank * (inter // world), (rank + 1) * (inter // world)
    gate_up = _slice_rows(mlp.gate_up_proj.weight.data, inter, a, b)
    mlp.gate_up_proj = nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False, device="meta")
    mlp.gate_up_proj.weight = nn.Parameter(gate_up, requires_grad=False)
    down = mlp.down_proj.weight.data[:, a:b].contiguous()
    mlp.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False, device="meta")
    mlp.down_proj.weight = nn.Parameter(down, requires_grad=False)


def shard_experts(experts: MoEExperts, group: RankGroup, expert_parallel: bool,
                  redundant_experts: int = 0) -> MoEExperts:
    """This rank's share of a layer's routed experts: with `expert_parallel`, whole experts in
    contiguous ranges (the balancer moves them later) and `redundant_experts` extra slots; else
    every expert's intermediate rows sliced, in place."""
    if expert_parallel:
        placement = contiguous_placement(experts.num_experts, group.world, redundant_experts)
        return LocalExperts(experts, placement, group.rank)
    slice_experts(experts, group.rank, group.world)
    return experts


def shard_sparse_block(block: SparseMoeBlock, group: RankGroup, expert_parallel: bool,
                       redundant_experts: int = 0) -> ReducedBlock:
    """`block` with this rank's share of its experts and shared expert, wrapped in the all-reduce of
    its output."""
    block.experts = shard_experts(block.experts, group, expert_parallel, redundant_experts)
    if block.shared_expert is not None:
        slice_dense_mlp(block.shared_expert, group.rank, group.world)
    return ReducedBlock(block, group)
