"""The two linears a sharded layer is made of: a plain `nn.Linear` over a rank's slice of a weight
(column-parallel: no collective), and `RowParallelLinear`, whose partial sums are all-reduced."""
from __future__ import annotations

import torch
from torch import nn

from cluster.parallel.group import RankGroup


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return out


class RowParallelLinear(nn.Module):
    """A rank's input columns of a linear; the partial sums all-reduced (one collective)."""

    def __init__(self, inner: nn.Linear, group: RankGroup):
        super().__init__()
        self.inner = inner       # a plain nn.Linear: the kernel plan may swap it for its layout
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner.forward(x))
