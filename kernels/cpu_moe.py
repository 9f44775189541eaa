"""Mixture-of-experts on the CPU: tokens grouped by expert, one GEMM per expert over its tokens.
Same signature as kernels/moe_reference.py.

An expert with few tokens (decode: at batch 8 and top-8 of 128 most experts get one) goes through
the C linear kernel, which streams each weight row once for all its rows and has no per-call
dispatch of its own; an expert with many (prefill) through BLAS, which blocks for cache reuse."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.moe_reference import fused_moe_reference

C_MAX_ROWS = 16   # an expert's GEMM on at most this many tokens runs the C kernel


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] <= C_MAX_ROWS:
        return cpu_ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    return fused_moe_reference(hidden, gate_up, down, topk_ids, topk_weights, linear=_grouped_linear)
