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
    """Experts [start, start + count) of the layer's: routing ids stay global (the load counters
    count every expert); pairs routed to other ranks' experts do not run here."""

    def __init__(self, experts: MoEExperts, start: int, count: int):
        hidden = experts.gate_up.shape[2]
        super().__init__(0, hidden, experts.down.shape[2], experts.layer)   # no full-size scratch
        self.num_experts = experts.num_experts   # the load counters count every expert
        self.gate_up = nn.Parameter(experts.gate_up.data[start:start + count].clone(), requires_grad=False)
        self.down = nn.Parameter(experts.down.data[start:start + count].clone(), requires_grad=False)
        self.start, self.count, self.path = start, count, experts.path

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Only the (token, expert) pairs routed here run: one row each (k = 1), token by token in
        ascending expert order, added into their tokens' rows."""
        self._count_tokens(topk_ids)
        k, flat_ids = topk_ids.shape[1], topk_ids.reshape(-1)
        pairs = ((flat_ids >= self.start) & (flat_ids < self.start + self.count)).nonzero().squeeze(1)
        pairs = pairs[torch.argsort((pairs // k) * self.num_experts + flat_ids[pairs], stable=True)]
        out = torch.zeros_like(hidden)
        if pairs.numel() == 0:
            return out
        rows = pairs // k
        part = moe_compute(self.path, hidden.device)(
            hidden.index_select(0, rows), self.gate_up, self.down, (flat_ids[pairs] - self.start)[:, None],
            topk_weights.reshape(-1)[pairs][:, None])
        return out.index_add_(0, rows, part)

    def _count_tokens(self, topk_ids: torch.Tensor) -> None:
        flat = topk_ids.reshape(-1)
        if self.tokens is None or self.tokens.device != flat.device:
            self.tokens = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        self.tokens.index_add_(0, flat, torch.ones_like(flat))



def _split(n: int, rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def _slice_rows(weight: torch.Tensor, inter: int, a: int, b: int) -> torch.Tensor:
    """Gate rows a:b and up rows a:b of a fused [.., 2I, H] weight."""
    return torch.cat([weight[..., a:b, :], weight[..., inter + a:inter + b, :]], dim=-2).contiguous()


def _slice_experts(experts: MoEExperts, rank: int, world: int) -> None:
    inter = experts.down.shape[2]
    if inter % world:
        raise ValueError(f"expert intermediate size {inter} does not split over {world} tensor-parallel ranks "
                         "(--enable-expert-parallel places whole experts instead)")
    a, b = rank * (inter // world), (rank + 1) * (inter // world)
    experts.gate_up = nn.Parameter(_slice_rows(experts.gate_up.data, inter, a, b), requires_grad=False)
    experts.down = nn.Parameter(experts.down.data[..., a:b].contiguous(), requires_grad=False)


def _slice_shared(block: SparseMoeBlock, rank: int, world: int) -> None:
    shared = block.shared_expert
    inter = shared.down_proj.in_features
    if inter % world:
        raise ValueError(f"shared expert intermediate size {inter} does not split over {world} ranks")
    a, b = rank * (inter // world), (rank + 1) * (inter // world)
    gate_up = _slice_rows(shared.gate_up_proj.weight.data, inter, a, b)
    shared.gate_up_proj = nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False, device="meta")
    shared.gate_up_proj.weight = nn.Parameter(gate_up, requires_grad=False)
    down = shared.down_proj.weight.data[:, a:b].contiguous()
    shared.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False, device="meta")
    shared.down_proj.weight = nn.Parameter(down, requires_grad=False)


def shard_sparse_block(block: SparseMoeBlock, group: RankGroup, expert_parallel: bool) -> ReducedBlock:
    """`block` with this rank's share of its experts, wrapped in the all-reduce of its output."""
    if expert_parallel:
        start, count = _split(block.experts.num_experts, group.rank, group.world)
        block.experts = LocalExperts(block.experts, start, count)
    else:
        _slice_experts(block.experts, group.rank, group.world)
    if block.shared_expert is not None:
        _slice_shared(block, group.rank, group.world)
    return ReducedBlock(block, group)
