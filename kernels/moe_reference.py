"""Mixture-of-experts compute in torch: the reference every fused MoE kernel is held to.

`fused_moe_reference(hidden, gate_up, down, topk_ids, topk_weights)` is the signature the fused
kernels share (kernels/fused_moe.py on CUDA, kernels/cpu_moe.py on CPU): experts stacked as
gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I]; each token's k chosen experts
with their routing weights. Tokens are grouped by expert (one GEMM per expert over its tokens,
not one per token) and each token's k outputs are added into its row in ascending expert order,
as transformers does, so float32 results match it bit for bit where the GEMMs do.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@torch.no_grad()
def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(the flat (token, slot) indices sorted by expert, stable; the count per expert as a list)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [rows, 2I] (gate columns, then up), each rounded to the dtype."""
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def fused_moe_reference(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, linear: Linear = F.linear,
                        activation: Callable[[torch.Tensor], torch.Tensor] = silu_mul) -> torch.Tensor:
    """hidden [T, H]; topk_ids [T, k] (int64); topk_weights [T, k] -> [T, H] in hidden's dtype.
    `linear(x, w, None)`: the GEMM (a batch-invariant one in the deterministic mode, whose per-row
    arithmetic does not depend on how many tokens an expert got); `activation`: SiLU-times-up of
    an expert's [rows, 2I] (the C kernel's exp rounds differently from torch's in float32)."""
    k = topk_ids.shape[1]
    out = torch.zeros_like(hidden)
    order, counts = group_by_expert(topk_ids, gate_up.shape[0])
    weights = topk_weights.reshape(-1)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        picks = order[start:start + n]
        start += n
        rows = picks // k
        gu = linear(hidden.index_select(0, rows), gate_up[expert], None)
        y = linear(activation(gu), down[expert], None) * weights.index_select(0, picks)[:, None]
        out.index_add_(0, rows, y.to(hidden.dtype))
    return out
