"""Batch-invariant linear and RMSNorm for CUDA (batch-invariant mode of the kernel plan).

cuBLAS and torch's reductions choose their tiling, split-K and reduction trees by shape, so the
rounding of one row's result depends on how many rows share the call: the same prompt gives
other bits in another batch. These kernels fix every choice: one tile config whatever M is, K
reduced in BLOCK_K tiles in order with no split, one program per row for the norm. A row's
arithmetic then depends on nothing but its own data (rows padded with zeros by the masked loads
contribute only to their own, discarded, outputs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_flags, interpreting, next_pow2

# One config for every shape (never chosen by M). Smaller tiles under the interpreter keep the
# tests' tiny shapes spread over several tiles of M, N and K.
_MATMUL = (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=1) if interpreting()
           else dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3))


@triton.jit
def _round(x, dtype: tl.constexpr, RNE_BITS: tl.constexpr):
    """fp32 -> dtype, to nearest even. The interpreter truncates fp32 -> bf16, so there the
    rounding is done on the bits (RNE_BITS), to give the GPU's (and torch's) values."""
    if RNE_BITS:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, RNE_BITS: tl.constexpr, SUM_DOT: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):   # K in order, every tile the same width: zeros pad the tail
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if SUM_DOT:   # the interpreter: products summed row by row, not through BLAS (see matmul)
            acc += tl.sum(x.to(tl.float32)[:, :, None] * tl.trans(w).to(tl.float32)[None, :, :], 1)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:   # in fp32 before the one rounding, as the fused CPU kernel and cuBLAS's epilogue do
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             _round(acc, out_ptr.dtype.element_ty, RNE_BITS), mask=m_mask[:, None] & n_mask[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row's bits independent of the other rows: x [..., K]
    (rows may be strided, last dim contiguous), weight [N, K], bias [N]; fp32 accumulation,
    output in x's dtype. Under the interpreter tl.dot is numpy's BLAS matmul, whose rounding of a
    row follows its place in the tile on some CPUs (OpenBLAS on Zen 4: 10 of 16 rows of a 16x16
    tile differ from the same row alone), so there the tile's products are summed elementwise."""
    k = x.shape[-1]
    n = weight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        cfg = dict(_MATMUL)
        precision, upcast = dot_flags(x.dtype)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        _matmul_kernel[grid](x2, weight, bias if bias is not None else out, out, m, n, k,
                             x2.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                             PRECISION=precision, UPCAST=upcast, RNE_BITS=_rne_bits(x.dtype),
                             SUM_DOT=interpreting(), **cfg)
    return out.view(*lead, n)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, hidden, hidden_f, stride_x, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, RNE_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    v = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:   # the sum rounded to the dtype, stored, and normalised as rounded
        r = _round(v + tl.load(res_ptr + row * hidden + offs, mask=mask, other=0.0).to(tl.float32), dtype, RNE_BITS)
        tl.store(res_ptr + row * hidden + offs, r, mask=mask)
        v = r.to(tl.float32)
    # IEEE sqrt and division (Triton's defaults are approximate), as torch and the C kernel round.
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(v * v, 0), hidden_f) + eps))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Normalised in fp32, rounded to the dtype, then times the weight, rounded again (Llama's
    # RMSNorm). The product of two 16-bit values is exact in fp32: one rounding, as in the dtype.
    normed = _round(v * inv, dtype, RNE_BITS).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, _round(w * normed, dtype, RNE_BITS), mask=mask)


def _rne_bits(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreting()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * norm(x) over the last dim of a 2-D x (rows may be strided, last dim contiguous),
    one program per row. With `residual` (contiguous [rows, hidden]): residual += x in place
    first (rounded to the dtype) and the norm is of the sum. Returns a new [rows, hidden]."""
    rows, hidden = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else out, weight, out, hidden, float(hidden),
                                  x.stride(0), float(eps), HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(hidden),
                                  RNE_BITS=_rne_bits(x.dtype))
    return out
