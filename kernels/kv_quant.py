"""Quantized KV rows (`--kv-cache-dtype int8|fp8_e4m3`) for the Triton kernels: the format's
encode and decode as device helpers, and which kind a cache tensor holds.

The format is cluster/kv/kv_quant.py's (its `quantize_rows` is the reference these helpers match
byte for byte): a row of one (token, KV head) is D one-byte values, then the two bytes of an fp16
scale s; value = q * s (int8) or e4m3(q) * s (fp8, raw E4M3FN bytes in a uint8 cache). The
rounding is written out in comparisons and integer bit arithmetic rather than left to casts:
the interpreter's fp32 -> fp8 cast is not round-to-nearest-even, and a `v + 1.5*2^23` rounding
trick could be contracted into an FMA by the compiler, rounding the product only once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_PLAIN, KV_INT8, KV_FP8 = 0, 1, 2   # the kernels' KV_QUANT constexpr
SCALE_BYTES = 2

# cluster/kv/kv_quant.py's cache_kind, duplicated: kernels is a leaf package and never imports
# cluster. The arena's dtype says what it holds (int8: int8 rows; uint8: E4M3FN bytes).
_KINDS = {torch.int8: KV_INT8, torch.uint8: KV_FP8}
MAX_VALUE = {KV_INT8: 127.0, KV_FP8: 448.0}


def kv_quant_of(cache: torch.Tensor) -> int:
    """KV_PLAIN, KV_INT8 or KV_FP8, from the cache tensor's dtype."""
    return _KINDS.get(cache.dtype, KV_PLAIN)


def check_row_width(cache: torch.Tensor, head_dim: int, quant: int) -> None:
    """A quantized cache's rows carry the scale after the values: D + 2 bytes."""
    want = head_dim + SCALE_BYTES if quant else head_dim
    if cache.shape[-1] != want:
        raise ValueError(f"KV cache rows of {cache.shape[-1]} elements for head dim {head_dim} "
                         f"({'quantized: D + 2 expected' if quant else 'D expected'})")


@triton.jit
def _round_half_even(v):
    """torch.round of an fp32 tensor (|v| < 2^22), as an fp32 tensor."""
    r = tl.floor(v)
    half = r + 0.5
    odd = (r.to(tl.int32) & 1) == 1
    up = (v > half) | ((v == half) & odd)
    return r + up.to(tl.float32)


@triton.jit
def _e4m3_bits(y):
    """E4M3FN bits (int32, 0..255) of fp32 y with |y| <= 448, round to nearest even, as torch's
    cast to float8_e4m3fn: normals by rounding the fp32 bits to 3 mantissa bits (a carry moves
    into the exponent), subnormals (|y| < 2^-6, steps of 2^-9) by rounding |y| * 2^9."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    abits = a.to(tl.int32, bitcast=True)
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)   # fp32 bias 127, E4M3 bias 7
    sub = _round_half_even(a * 512.0).to(tl.int32)
    return tl.where(a < 0.015625, sub, normal) | sign


@triton.jit
def _quantize(x, KV_QUANT: tl.constexpr, MAX: tl.constexpr):
    """x [R, D] fp32 (padding lanes 0) -> (values [R, D] int32 bytes to store, fp16 scale [R])."""
    s16 = tl.math.div_rn(tl.max(tl.abs(x), 1), MAX).to(tl.float16)
    s = s16.to(tl.float32)
    inv = tl.where(s == 0, 0.0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.where(s == 0, 1.0, s)))
    v = x * inv[:, None]
    if KV_QUANT == 1:
        q = tl.minimum(tl.maximum(_round_half_even(v), -127.0), 127.0).to(tl.int32)
    else:
        q = _e4m3_bits(tl.minimum(tl.maximum(v, -448.0), 448.0))
    return q, s16


@triton.jit
def _store_scale(ptr, s16, mask):
    """The fp16 scale's two bytes, little-endian as the reference's view of it."""
    bits = s16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    dtype = ptr.dtype.element_ty
    tl.store(ptr, (bits & 0xFF).to(dtype), mask=mask)
    tl.store(ptr + 1, (bits >> 8).to(dtype), mask=mask)


@triton.jit
def _load_scale(ptr, mask):
    """The fp16 scale at `ptr` (byte by byte: a row's offset is only even when D is) as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequantize(raw, scale, KV_QUANT: tl.constexpr):
    """Value bytes [N, D] times their row's scale [N], in fp32 (the reference's arithmetic)."""
    if KV_QUANT == 1:
        x = raw.to(tl.float32)
    else:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return x * scale[:, None]
