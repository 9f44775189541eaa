"""The linear-layer paths a kernel plan can choose (`KernelPlan.linear`), one per model.

- packed: bf16/fp16 weights reordered once into oneDNN's blocked layout. On a Zen 4 without AMX
  a 32000x512 bf16 projection at batch 1 takes 1.6 ms packed against 2.7 ms plain; on a machine
  with AMX the ranking can differ, which is why the plan measures.
- fp32_upcast: a 16-bit model's weights kept in float32 (MKL sgemm), twice the weight memory,
  which the engine's memory plan counts (the weights are buffers of these modules); optionally
  with the C kernel below on those float32 weights for small passes. Chosen where the CPU has no
  bf16 instructions (bf16 GEMMs are emulated there).
- plain: torch's F.linear in the model's dtype (nn.Linear as loaded), optionally with the fused C
  kernel (`kernels/cpu_ops.linear`) for passes of up to `c_rows` rows: it streams each weight row
  once for all rows, and on a Zen 4 runs a float32 decode step's linears 3-4x faster than MKL.
- invariant (batch-invariant mode): every row computed with one fixed reduction order whatever
  the number of rows: the C kernel at any row count on CPU, the fixed-tile Triton matmul of
  kernels/batch_invariant.py on CUDA. BLAS and oneDNN choose their blocking (and split K) by
  shape, so a row's rounding there depends on how many rows share the call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.kernel_plan import LinearPath, packing_available  # noqa: F401 (re-exported: its callers find it here)
from kernels import cpu_ops

# The op overload resolved once: calling through the OpOverloadPacket costs a lookup per call.
_linear_pointwise = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)


class SmallBatchLinear(nn.Module):
    """nn.Linear's weights as they are; passes of up to `c_rows` rows through the C kernel."""

    def __init__(self, linear: nn.Linear, c_rows: int):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight          # shared, not copied (a tied LM head stays tied)
        self.bias = linear.bias
        self.c_rows = c_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.c_rows:
            return cpu_ops.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class InvariantLinear(nn.Module):
    """nn.Linear's weights as they are; every pass through a kernel whose per-row arithmetic does
    not depend on the row count."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight          # shared, not copied (a tied LM head stays tied)
        self.bias = linear.bias
        if self.weight.device.type == "cpu":
            self._fn = cpu_ops.linear
        else:
            from kernels.batch_invariant import matmul  # noqa: PLC0415 - Triton is optional: CUDA only
            self._fn = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        if not packing_available(weight.dtype, weight.device):
            name = str(weight.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float16", "fp16")
            raise ValueError(f"the packed linear path needs oneDNN's {name} packing, which this CPU lacks "
                             "(AVX-512 bw/vl/dq or AVX-NE-CONVERT): use a kernel plan with linear plain or fp32_upcast")
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Fp32UpcastLinear(nn.Module):
    def __init__(self, linear: nn.Linear, c_rows: int = 0):
        super().__init__()
        self.c_rows = c_rows
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("weight", linear.weight.detach().float().contiguous(), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.c_rows:
            return cpu_ops.linear(x.float(), self.weight, self.bias).to(x.dtype)
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def linear_module(linear: nn.Linear, path: LinearPath, c_rows: int = 0) -> nn.Module:
    """`linear` as `path` computes it (with the C kernel for passes of up to `c_rows` rows where
    the path has one)."""
    if path is LinearPath.PACKED:
        return PackedLinear(linear)
    if path is LinearPath.INVARIANT:
        return InvariantLinear(linear)
    if path is LinearPath.FP32_UPCAST:
        return Fp32UpcastLinear(linear, c_rows)
    return SmallBatchLinear(linear, c_rows) if c_rows else linear


def apply_linear_path(model: nn.Module, path: LinearPath, c_rows: int = 0) -> int:
    """Replace every nn.Linear under `model` by `path`'s module; returns how many were replaced.
    A tied lm_head (the embedding's weight) keeps the embedding table as it is: only the head's
    copy changes layout."""
    if path is LinearPath.PLAIN and not c_rows:
        return 0
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, linear_module(child, path, c_rows))
                count += 1
    return count
