"""A kernel plan made callable for one forward pass.

`ForwardPass` is built once per pass (the target model's, the EAGLE head's, a draft model's) from
the pass's row count: it looks up the plan's bucket once and gathers RoPE's cos/sin once, so the
per-layer calls are plain method calls with no choice left to make.
"""
from __future__ import annotations

import torch

import torch.nn.functional as F

from cluster.model.kernel_plan import ActPath, KernelPlan, NormPath, RopePath
from kernels import cpu_ops


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
    def __init__(self, plan: KernelPlan, positions: torch.Tensor, rotary, dtype: torch.dtype, backend, meta,
                 local_rotary=None):
        """`local_rotary`: the RoPE table of the layers that run with `local=True` (Gemma 3's
        sliding layers); None: every layer uses `rotary`."""
        bucket = plan.buckets.index(positions.shape[0])
        self.backend = backend
        self.meta = meta
        self.positions = positions
        self.rotary = rotary
        self.local_rotary = rotary if local_rotary is None else local_rotary
        self.norm_path = plan.norm[bucket]
        self.rope_path = plan.rope[bucket]
        self.act_path = plan.act[bucket]
        self.c_ops = None
        self.triton_norm = None
        if self.norm_path is NormPath.TRITON:
            from kernels.batch_invariant import rms_norm  # noqa: PLC0415 - Triton is optional: CUDA only
            self.triton_norm = rms_norm
        if (self.norm_path is NormPath.FUSED_C or self.rope_path is RopePath.FUSED_C
                or self.act_path is ActPath.FUSED_C):
            self.c_ops = cpu_ops
        # RoPE, K/V store and attention of a layer as one C call: pure decode on the fused paths.
        ready = getattr(backend, "fused_block_ready", None)
        self.fused_block = self.rope_path is RopePath.FUSED_C and ready is not None and ready(meta)
        # Cross-layer KV sharing: {source layer: its (k, v) rows of this pass}, read by the layers
        # that attend its cache (cluster/model/llama.py).
        self.kv_rows: dict[int, tuple] = {}
        self.layer_inputs: torch.Tensor | None = None   # Gemma 4's per-layer inputs [T, L, P] (per_layer_inputs.py)
        self.cos = self.sin = self.local_cos = self.local_sin = None
        if self.rope_path is RopePath.TORCH:
            self.cos, self.sin = rotary.lookup(positions, dtype)
            self.local_cos, self.local_sin = (self.cos, self.sin) if local_rotary is None else \
                local_rotary.lookup(positions, dtype)

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

    def rope(self, qkv: torch.Tensor, heads: int, head_dim: int, local: bool = False) -> torch.Tensor:
        """RoPE on the first `heads` heads (queries, then keys) of the fused projection [T, *];
        returns them as [T, heads, head_dim]. `local`: with the local table (see __init__)."""
        t = qkv.shape[0]
        if self.rope_path is RopePath.FUSED_C:
            rotary = self.local_rotary if local else self.rotary
            self.c_ops.rope_(qkv, self.positions, rotary.cos, rotary.sin, heads, head_dim)
            return qkv[:, : heads * head_dim].view(t, heads, head_dim)
        cos, sin = (self.local_cos, self.local_sin) if local else (self.cos, self.sin)
        return apply_rope(qkv[:, : heads * head_dim].view(t, heads, head_dim), cos, sin)

    def head_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor | None, heads: int,
                  kv_heads: int, head_dim: int, eps: float) -> None:
        """RMSNorm over each query and key head of the fused projection [T, *], in place, before
        RoPE (Qwen3, Gemma 3). Torch ops whatever the plan: the heads are strided rows; the
        rounding follows the plan's norm path (transformers' on the paths that mimic it)."""
        t = qkv.shape[0]
        norm = _torch_norm_fused if self.norm_path is NormPath.TORCH_FUSED else _torch_norm_ops
        q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
        q.copy_(norm(q, q_weight, eps))
        if k_weight is not None:   # None: queries only (a layer sharing another's K/V)
            k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
            k.copy_(norm(k, k_weight, eps))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [T, 2I] projection."""
        if self.act_path is ActPath.FUSED_C:
            return self.c_ops.silu_mul(gate_up)
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]

    @staticmethod
    def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate) * up (tanh approximation: transformers' gelu_pytorch_tanh, GeGLU), torch ops."""
        half = gate_up.shape[-1] // 2
        return F.gelu(gate_up[:, :half], approximate="tanh") * gate_up[:, half:]
