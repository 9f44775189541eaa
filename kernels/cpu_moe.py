"""Mixture-of-experts on the CPU: tokens grouped by expert, one GEMM per expert over its tokens.
Same signature as kernels/moe_reference.py.

`fused_moe`: one C call per layer where parallel.cpp is built (`cpu_ops.moe_experts`): the
sorted pairs' rows gathered, every active expert's gate_up, SiLU-times-up and down as work items
over torch's threads, the weighted rows added in ascending expert order. Its GEMM is the C linear
(batch-invariant, streaming each weight row once for all of an expert's rows): at decode most
experts get one or two rows, where BLAS gains nothing and Python's per-expert calls cost the most.
An expert of more than C_MAX_ROWS tokens (prefill) goes through torch's GEMM first (at 64 rows
an expert, oneDNN's bf16 GEMM took half the C linear's time: the C linear streams the weights
once per 8 rows), except in the deterministic mode, where every expert takes the C linear.
`grouped_moe`: the same grouping with a Python loop over experts (the C linear for an expert's
small groups, BLAS for large ones), where the C call is not built. Both round where the reference
rounds: their results equal `fused_moe_reference` given the same GEMM and SiLU per expert, bit for
bit in float32 and bfloat16."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.moe_reference import fused_moe_reference, silu_mul

C_MAX_ROWS = 16   # grouped_moe: an expert's GEMM on at most this many tokens runs the C kernel


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] <= C_MAX_ROWS:
        return cpu_ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _grouped_act(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.shape[0] <= C_MAX_ROWS:
        return cpu_ops.silu_mul(gate_up)
    return silu_mul(gate_up)


def grouped_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
    """An expert of at most C_MAX_ROWS tokens on the C linear and the C SiLU, a larger one on
    torch's: the arithmetic of `fused_moe`, one Python call per expert."""
    return fused_moe_reference(hidden, gate_up, down, topk_ids, topk_weights, linear=_grouped_linear,
                               activation=_grouped_act)


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """`invariant`: every expert through the C linear (batch-invariant: the deterministic mode);
    else an expert of more than C_MAX_ROWS tokens through BLAS first, the rest in the C call."""
    if hidden.dtype not in (torch.float32, torch.bfloat16):   # the C ops' dtypes
        return fused_moe_reference(hidden, gate_up, down, topk_ids, topk_weights)
    if not cpu_ops.has_moe_experts():
        return grouped_moe(hidden, gate_up, down, topk_ids, topk_weights)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=down.shape[0])
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    rows = order // k
    y = torch.empty((flat.numel(), hidden.shape[1]), dtype=hidden.dtype)
    if not invariant:
        _blas_experts(hidden, gate_up, down, rows, starts, y)
    out = torch.zeros_like(hidden)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    cpu_ops.moe_experts(hidden, gate_up.contiguous(), down.contiguous(), rows, starts,
                        topk_weights.reshape(-1).float().index_select(0, order).contiguous(), y, out,
                        -1 if invariant else C_MAX_ROWS)
    return out


def fused_moe_invariant(hidden, gate_up, down, topk_ids, topk_weights) -> torch.Tensor:
    return fused_moe(hidden, gate_up, down, topk_ids, topk_weights, invariant=True)


def _blas_experts(hidden, gate_up, down, rows, starts, y) -> None:
    """y's rows of the experts of more than C_MAX_ROWS tokens, by torch's GEMM (rounded as the reference)."""
    bounds = starts.tolist()
    for expert in range(down.shape[0]):
        a, b = bounds[expert], bounds[expert + 1]
        if b - a <= C_MAX_ROWS:
            continue
        gu = F.linear(hidden.index_select(0, rows[a:b]), gate_up[expert])
        y[a:b] = F.linear(silu_mul(gu), down[expert])
