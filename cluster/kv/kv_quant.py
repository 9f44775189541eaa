"""Quantized KV cache rows (`--kv-cache-dtype int8|fp8_e4m3`): the format, and its torch reference.

A quantized arena keeps, for every (token, KV head), the head's D values as one byte each and then
their fp16 scale in two more bytes: the arena's last dimension is D + 2 instead of D. Scales live
inside the block they describe, so everything that moves or checks blocks as bytes (the transports,
the checksums, the prefix cache, a fork's block copy) moves and checks the scales with the values,
and a P/D handoff of an int8 block is (D + 2) / 2D of a bf16 one's bytes.

    int8:      q = round(x / s), s = max|x| / 127 (s rounded to fp16 first; q in [-127, 127])
    fp8_e4m3:  q = e4m3(x / s),  s = max|x| / 448 (OCP E4M3FN, round to nearest even)

The arena's dtype says which: int8 for int8, uint8 (raw E4M3FN bytes) for fp8. This module is the
reference the C kernels (kernels/cpu/kv_quant.c) are tested against, and the path of everything that
gathers rows before attending (the torch backend's SDPA paths).
"""
from __future__ import annotations

import enum

import torch

SCALE_BYTES = 2   # an fp16 scale per (token, KV head), after the head's values


class KVCacheDType(enum.Enum):
    AUTO = "auto"           # the model's dtype (--dtype): no quantization
    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def quantized(self) -> bool:
        return self is not KVCacheDType.AUTO

    @property
    def arena_dtype(self) -> torch.dtype:
        return {KVCacheDType.INT8: torch.int8, KVCacheDType.FP8_E4M3: torch.uint8}[self]

    @property
    def max_value(self) -> float:
        return {KVCacheDType.INT8: 127.0, KVCacheDType.FP8_E4M3: 448.0}[self]


def cache_kind(cache: torch.Tensor) -> KVCacheDType:
    """What a cache tensor holds, read from its dtype (int8: int8 rows; uint8: E4M3 rows)."""
    if cache.dtype == torch.int8:
        return KVCacheDType.INT8
    if cache.dtype == torch.uint8:
        return KVCacheDType.FP8_E4M3
    return KVCacheDType.AUTO


def row_width(head_dim: int, kind: KVCacheDType) -> int:
    """Elements of the arena's last dimension for one (token, head)."""
    return head_dim + SCALE_BYTES if kind.quantized else head_dim


def quantize_rows(x: torch.Tensor, kind: KVCacheDType) -> torch.Tensor:
    """x [..., D] float -> [..., D + 2] in the arena's dtype: the values, then the fp16 scale's bytes."""
    xf = x.float()
    scale16 = (xf.abs().amax(dim=-1, keepdim=True) / kind.max_value).to(torch.float16)
    s = scale16.float()
    scaled = xf * torch.where(s == 0, 0.0, 1.0 / torch.where(s == 0, 1.0, s))
    if kind is KVCacheDType.INT8:
        values = torch.round(scaled).clamp(-127, 127).to(torch.int8)
    else:
        values = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([values, scale16.view(kind.arena_dtype)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype, int4_view: bool = False) -> torch.Tensor:
    """[..., D + 2] quantized rows (int8 or E4M3 bytes) -> [..., D] in `dtype` (value * scale in fp32).
    `int4_view`: int8 rows read through their int4 view (int4_values)."""
    kind = cache_kind(rows)
    values = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    if kind is KVCacheDType.INT8:
        xf = int4_values(values) if int4_view else values.float()
    else:
        xf = values.contiguous().view(torch.float8_e4m3fn).float()
    return (xf * scale).to(dtype)


def int4_values(values: torch.Tensor) -> torch.Tensor:
    """The int4 view of int8 values (QuantSpec's hierarchical KV cache): each value's top nibble,
    at the middle of its 16-wide step, so |error| <= 8 steps of the int8 scale. A draft reading the
    target's int8 cache through it sees a 4-bit cache; the target reads all eight bits."""
    return ((values.to(torch.int16) & -16) + 8).float()
