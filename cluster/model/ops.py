"""A kernel plan made callable for one forward pass.

`ForwardPass` is built once per pass (the target model's, the EAGLE head's, a draft model's) from
the pass's row count: it looks up the plan's bucket once and gathers RoPE's cos/sin once, so the
per-layer calls are plain method calls with no choice left to make.
"""
from __future__ import annotations

import torch

import torch.nn.functional as F

from cluster.model.kernel_plan import ActPath, KernelPlan, NormPath, RopePath


def _torch_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return weight * torch.rms_norm(x, weight.shape, eps=eps)
    # One op; the weight multiply happens in fp32 before the single rounding.
    return torch.rms_norm(x, weight.shape, weight, eps=eps)


def _torch_norm_ops(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face layout) on [T, H, D]: x*cos + rotate_half(x)*sin, with
    rotate_half(x)*sin == cat(x2, x1) * cat(-sin, sin) bit for bit."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class ForwardPass:
    def __init__(self, plan: KernelPlan, positions: torch.Tensor, rotary, dtype: torch.dtype, backend, meta):
        bucket = plan.buckets.index(positions.shape[0])
        self.backend = backend
        self.meta = meta
        self.positions = positions
        self.rotary = rotary
        self.norm_path = plan.norm[bucket]
        self.rope_path = plan.rope[bucket]
        self.act_path = plan.act[bucket]
        self.c_ops = None
        self.triton_norm = None
        if self.norm_path is NormPath.TRITON:
            from kernels.batch_invariant import rms_norm  # noqa: PLC0415  (Triton: CUDA only)
            self.triton_norm = rms_norm
        if (self.norm_path is NormPath.FUSED_C or self.rope_path is RopePath.FUSED_C
                or self.act_path is ActPath.FUSED_C):
            from kernels import cpu_ops  # noqa: PLC0415  (built when the plan was applied)
            self.c_ops = cpu_ops
        # RoPE, K/V store and attention of a layer as one C call: pure decode on the fused paths.
        ready = getattr(backend, "fused_block_ready", None)
        self.fused_block = self.rope_path is RopePath.FUSED_C and ready is not None and ready(meta)
        self.cos = self.sin = None
        if self.rope_path is RopePath.TORCH:
            self.cos, self.sin = rotary.lookup(positions, dtype)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.norm_path is NormPath.FUSED_C:
            return self.c_ops.rms_norm(x, weight, eps)
        if self.norm_path is NormPath.TRITON:
            return self.triton_norm(x, weight, eps)
        if self.norm_path is NormPath.TORCH_OPS:
            return _torch_norm_ops(x, weight, eps)
        return _torch_norm_fused(x, weight, eps)

    def add_norm(self, delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += delta (in place, rounded to the dtype), then the norm of the sum."""
        if self.norm_path is NormPath.FUSED_C:
            return self.c_ops.rms_norm(delta, weight, eps, residual=residual)
        if self.norm_path is NormPath.TRITON:
            return self.triton_norm(delta, weight, eps, residual=residual)
        residual.add_(delta)
        return self.norm(residual, weight, eps)

    def rope(self, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """RoPE on the first `heads` heads (queries, then keys) of the fused projection [T, *];
        returns them as [T, heads, head_dim]."""
        t = qkv.shape[0]
        if self.rope_path is RopePath.FUSED_C:
            self.c_ops.rope_(qkv, self.positions, self.rotary.cos, self.rotary.sin, heads, head_dim)
            return qkv[:, : heads * head_dim].view(t, heads, head_dim)
        return apply_rope(qkv[:, : heads * head_dim].view(t, heads, head_dim), self.cos, self.sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [T, 2I] projection."""
        if self.act_path is ActPath.FUSED_C:
            return self.c_ops.silu_mul(gate_up)
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]
