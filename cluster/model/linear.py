"""The linear-layer paths a kernel plan can choose (`KernelPlan.linear`), one per model.

- packed: bf16/fp16 weights reordered once into oneDNN's blocked layout. On a Zen 4 without AMX
  a 32000x512 bf16 projection at batch 1 takes 1.6 ms packed against 2.7 ms plain; on a machine
  with AMX the ranking can differ, which is why the plan measures.
- fp32_upcast: a 16-bit model's weights kept in float32 (MKL sgemm), twice the weight memory,
  which the engine's memory plan counts (the weights are buffers of these modules).
- plain: torch's F.linear in the model's dtype (nn.Linear as loaded).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.kernel_plan import LinearPath

# The op overload resolved once: calling through the OpOverloadPacket costs a lookup per call.
_linear_pointwise = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available() and _linear_pointwise is not None)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Fp32UpcastLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("weight", linear.weight.detach().float().contiguous(), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def apply_linear_path(model: nn.Module, path: LinearPath) -> int:
    """Replace every nn.Linear under `model` by `path`'s module; returns how many were replaced.
    A tied lm_head (the embedding's weight) keeps the embedding table as it is: only the head's
    copy changes layout."""
    if path is LinearPath.PLAIN:
        return 0
    wrap = PackedLinear if path is LinearPath.PACKED else Fp32UpcastLinear
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, wrap(child))
                count += 1
    return count
