"""Mixture-of-experts on the CPU: tokens grouped by expert, one GEMM per expert over its tokens.
Same signature as kernels/moe_reference.py.

`fused_moe`: one C call per layer where parallel.cpp is built (`cpu_ops.moe_experts`): the
sorted pairs' rows gathered, every active expert's gate_up, SiLU-times-up and down as work items
over torch's threads, the weighted rows added in ascending expert order. Its GEMM is the C linear
(batch-invariant, streaming each weight row once for all of an expert's rows): at decode most
experts get one or two rows, where BLAS gains nothing and Python's per-expert calls cost the most.
`grouped_moe`: the same grouping with a Python loop over experts (the C linear for an expert's
small groups, BLAS for large ones), where the C call is not built. Both round where the reference
rounds: float32 and bfloat16 results equal `fused_moe_reference` with the C linear bit for bit."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.moe_reference import fused_moe_reference

C_MAX_ROWS = 16   # grouped_moe: an expert's GEMM on at most this many tokens runs the C kernel


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] <= C_MAX_ROWS:
        return cpu_ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def grouped_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
    return fused_moe_reference(hidden, gate_up, down, topk_ids, topk_weights, linear=_grouped_linear)


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    if not cpu_ops.has_moe_experts() or hidden.dtype not in (torch.float32, torch.bfloat16):
        return grouped_moe(hidden, gate_up, down, topk_ids, topk_weights)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=down.shape[0])
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    out = torch.zeros_like(hidden)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    cpu_ops.moe_experts(hidden, gate_up.contiguous(), down.contiguous(), order // k, starts,
                        topk_weights.reshape(-1).float().index_select(0, order).contiguous(), out)
    return out
