"""What the engine builds differently for a latent-attention (MLA) model: its KV layout and its
attention backend, with the decode kernel the device runs. Refusals name what the latent layout
does not do."""
from __future__ import annotations

import torch

from cluster.config import CacheConfig
from cluster.model.attention import triton_mla_decode
from cluster.model.kernel_plan import KernelPlan
from cluster.model.mla import MLABackend
from cluster.model.model_config import ModelConfig
from cluster.types import KVLayout
from kernels import cpu_ops, mla_decode


def latent_layout(mc: ModelConfig, model_id: str, num_layers: int, cache: CacheConfig, dtype: str) -> KVLayout:
    if cache.kv_cache_dtype != "auto":
        raise ValueError(f"a quantized KV cache (--kv-cache-dtype {cache.kv_cache_dtype}) is not supported with "
                         "latent attention (MLA, DeepSeek): its cache is already one latent vector per token")
    return KVLayout.latent(model_id, num_layers, mc.mla.latent_dim, cache.block_size, dtype)


def mha_bytes_per_token(mc: ModelConfig, dtype: torch.dtype) -> int:
    """What the same model would cache per token with per-head K and V of its widths (the
    comparison the banner prints)."""
    mla = mc.mla
    item = torch.empty((), dtype=dtype).element_size()
    return mc.num_layers * mc.num_heads * (mla.qk_head_dim + mla.v_head_dim) * item


def latent_kv_line(mc: ModelConfig, dtype: torch.dtype, block_size: int) -> str | None:
    """The banner's line for a latent-attention model: KV bytes a token, against per-head K/V."""
    if mc.mla is None:
        return None
    per_token = KVLayout.latent(mc.model_id, mc.num_layers, mc.mla.latent_dim, block_size,
                                str(dtype).removeprefix("torch.")).bytes_per_token()
    mha = mha_bytes_per_token(mc, dtype)
    return (f"  KV layout: latent attention (MLA), one {mc.mla.latent_dim}-wide vector a token and layer: "
            f"{per_token:,} B a token, {per_token / mha:.1%} of per-head K and V ({mha:,} B)")


# The C op's register tiles beat torch's batched GEMMs up to this many heads (bench/deepseek_mla.py,
# one thread: 0.2-0.8x torch's time at 16 heads); at DeepSeek-V3's 128 heads torch's GEMMs are
# 1.5-2.6x faster, so the reference runs there.
C_DECODE_MAX_HEADS = 32


def make_mla_backend(name: str, latent_dim: int, num_heads: int, device: torch.device,
                     plan: KernelPlan | None) -> MLABackend:
    """`name`: --attention-backend. The absorbed decode runs the C op on CPU where the plan uses
    the fused C ops and the heads are few enough, Triton on CUDA (auto or triton), else the torch
    reference."""
    if plan is not None and plan.batch_invariant:
        raise ValueError("deterministic mode (--deterministic) is not supported with latent attention (MLA)")
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
    kernel = mla_decode.mla_decode_reference
    if device.type == "cuda" and name in ("auto", "triton"):
        kernel = triton_mla_decode()
    elif (device.type == "cpu" and plan is not None and plan.uses_c_ops() and cpu_ops.has_mla_decode()
          and num_heads <= C_DECODE_MAX_HEADS):
        kernel = cpu_ops.mla_decode
    return MLABackend(latent_dim, device, kernel)
