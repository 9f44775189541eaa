"""Weight-only quantized GEMM for CUDA (W8A16 / W4A16): x @ w.T with w in `cpu_quant`'s layout.

Reads a `QuantizedWeight` as packed for the CPU kernel (kernels/cpu_quant.py, cpu/quant.c), never
a copy: quants uint8 [tiles, k/32, 8, 32 (8-bit) or 16 (4-bit)], fp16 scales (and mins)
[tiles, k/32, 8], or fp32 scales [tiles * 8] for INT8 per output channel. A tile's 8 columns sit
side by side per block of 32 weights, so one block of BLOCK_N columns is BLOCK_N / 8 runs of
contiguous bytes.

The K loop steps one block of 32 weights. Quants are decoded in registers to the activation dtype
(small integers: exact in fp16/bf16) and multiplied by x on the tensor cores; the block's scale
applies to that fp32 partial, as the CPU kernel does: per block d * (x . q), plus m * sum(x) for
4-bit (Q4_0 is stored as Q4_1 with m = -8d). INT8's one scale per row applies once, at the end.
The 4-bit bytes hold elements out of order (byte 8h + i: element 16h + i low, 16h + 8 + i high), so
the x columns are gathered in that order instead of shuffling nibbles: a dot's sum does not care.

Leaf module: torch and triton only (through `_common`); the weight is read by attribute.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_flags, interpreting

# Kernel format codes: INT8 per row, Q8_0, and the 4-bit formats (one kernel for both).
_FORMATS = {"int8": 0, "q8_0": 1, "q4_0": 2, "q4_1": 2}
_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)

# A decode batch (up to 16 rows, tl.dot's minimum tile) gets narrow column tiles, for more
# programs; a prefill chunk 64 x 64, so each weight block read feeds 64 rows. 8 warps there: at 4
# the 4-bit tile took 212 registers a thread. fp32's IEEE dots take more registers still: 32 rows
# (64 spilled). Smaller tiles under the interpreter spread the tests' small shapes over several.
_DECODE_ROWS = 16
_DECODE = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=4)
_PREFILL = dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3)
_PREFILL_FP32 = dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=3)
_INTERPRET_DECODE = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
_INTERPRET_PREFILL = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)


@triton.jit
def _dot_q(x, q, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x @ q for an x tile and integer quants q [K, BLOCK_N], decoded to x's dtype (exact)."""
    if UPCAST:   # the interpreter's bf16 dot (and its int -> bf16 cast) is wrong: fp32 there
        return tl.dot(x.to(tl.float32), q.to(tl.float32), acc, input_precision=PRECISION)
    return tl.dot(x, q.to(x.dtype), acc, input_precision=PRECISION)


@triton.jit
def _block_8bit(x_rows, m_mask, q_cols, n_mask, kb, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """x . q over block kb of 32 int8 weights: fp32 [BLOCK_M, BLOCK_N], unscaled."""
    offs_k = tl.arange(0, 32)
    x = tl.load(x_rows + kb * 32 + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    q = tl.load(q_cols[None, :] + kb * 256 + offs_k[:, None], mask=n_mask[None, :], other=0)
    q = q.to(tl.int8, bitcast=True)
    return _dot_q(x, q, tl.zeros([x.shape[0], q.shape[1]], dtype=tl.float32), PRECISION, UPCAST)


@triton.jit
def _block_4bit(x_rows, m_mask, q_cols, n_mask, kb, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """(x . q, sum of x) over block kb of 32 nibbles: fp32 [BLOCK_M, BLOCK_N] and [BLOCK_M]."""
    offs_b = tl.arange(0, 16)
    # Byte b = 8h + i holds element 16h + i (low nibble) and 16h + 8 + i (high nibble).
    elem_lo = 16 * (offs_b // 8) + offs_b % 8
    x_lo = tl.load(x_rows + kb * 32 + elem_lo[None, :], mask=m_mask[:, None], other=0.0)
    x_hi = tl.load(x_rows + kb * 32 + 8 + elem_lo[None, :], mask=m_mask[:, None], other=0.0)
    q = tl.load(q_cols[None, :] + kb * 128 + offs_b[:, None], mask=n_mask[None, :], other=0)
    part = tl.zeros([x_lo.shape[0], q.shape[1]], dtype=tl.float32)
    part = _dot_q(x_lo, q & 15, part, PRECISION, UPCAST)
    part = _dot_q(x_hi, q >> 4, part, PRECISION, UPCAST)
    x_sum = tl.sum(x_lo.to(tl.float32), 1) + tl.sum(x_hi.to(tl.float32), 1)
    return part, x_sum


@triton.jit
def _quant_gemm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, out_ptr, M, N, KB, stride_xm, stride_om,
                       FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    # Column n's block kb: tile n // 8, block kb, slot n % 8. Its scale/min index is the same
    # walk with one entry per slot; its quants start QBYTES times further.
    slot = (offs_n // 8).to(tl.int64) * KB * 8 + offs_n % 8
    QBYTES: tl.constexpr = 16 if FORMAT == 2 else 32
    q_cols = q_ptr + slot * QBYTES
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, KB):
        if FORMAT == 0:   # one scale per row: applied after the loop
            acc += _block_8bit(x_rows, m_mask, q_cols, n_mask, kb, PRECISION, UPCAST)
        else:
            d = tl.load(s_ptr + slot + kb * 8, mask=n_mask, other=0.0).to(tl.float32)
            if FORMAT == 1:
                acc += _block_8bit(x_rows, m_mask, q_cols, n_mask, kb, PRECISION, UPCAST) * d[None, :]
            else:
                part, x_sum = _block_4bit(x_rows, m_mask, q_cols, n_mask, kb, PRECISION, UPCAST)
                mn = tl.load(m_ptr + slot + kb * 8, mask=n_mask, other=0.0).to(tl.float32)
                acc += part * d[None, :] + x_sum[:, None] * mn[None, :]
    if FORMAT == 0:
        acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:   # in fp32, before the output's one rounding
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _config(rows: int, dtype: torch.dtype) -> dict:
    decode = rows <= _DECODE_ROWS
    if interpreting():
        return dict(_INTERPRET_DECODE if decode else _INTERPRET_PREFILL)
    return dict(_DECODE if decode else _PREFILL_FP32 if dtype == torch.float32 else _PREFILL)


def triton_quant_linear(x: torch.Tensor, qweight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for x [..., K] (float32, bfloat16 or float16; rows may be strided, the last
    dim contiguous) and a `QuantizedWeight` on x's device; fp32 accumulation, output in x's dtype."""
    if x.dtype not in _ACTIVATIONS:
        raise TypeError(f"triton_quant_linear takes float32, bfloat16 or float16 activations, not {x.dtype}")
    k, n = x.shape[-1], qweight.n
    if k != qweight.k:
        raise ValueError(f"activations have {k} features, the weight {qweight.k}")
    if qweight.quants.device != x.device:
        raise ValueError(f"the weight is on {qweight.quants.device}, the activations on {x.device}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        cfg = _config(m, x.dtype)
        precision, upcast = dot_flags(x.dtype)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        mins = qweight.mins if qweight.mins is not None else qweight.scales   # unread but for 4-bit
        _quant_gemm_kernel[grid](x2, qweight.quants, qweight.scales, mins, bias if bias is not None else out, out,
                                 m, n, k // 32, x2.stride(0), out.stride(0), FORMAT=_FORMATS[qweight.format.value],
                                 HAS_BIAS=bias is not None, PRECISION=precision, UPCAST=upcast, **cfg)
    return out.view(*x.shape[:-1], n)
