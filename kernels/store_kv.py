"""store_kv: scatter the step's new K/V rows into the paged cache by flat slot.

One program per token moves that token's [Hkv, D] key and value (a few KiB: the kernel is pure
memory traffic, so the whole row goes in one vectorised load/store). Slot -1 marks a padding
token and is skipped, so callers may pad the batch (e.g. for CUDA graphs) without a scratch block.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels._common import next_pow2
from kernels.kv_quant import MAX_VALUE, _quantize, _store_scale, check_row_width, kv_quant_of


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slots,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache + blk * stride_cb + off * stride_cs + h * stride_ch + d, k, mask=mask)
        tl.store(v_cache + blk * stride_db + off * stride_ds + h * stride_dh + d, v, mask=mask)


@triton.jit
def _store_quant_kernel(k_ptr, v_ptr, k_cache, v_cache, slots,
                        stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr, MAX: tl.constexpr):
    """_store_kv_kernel for quantized caches: each (token, head) row quantized in registers."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
        _store_quant_rows(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :],
                          k_cache + blk * stride_cb + off * stride_cs + h * stride_ch, d, h < NUM_HEADS, mask,
                          HEAD_DIM, KV_QUANT, MAX)
        _store_quant_rows(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :],
                          v_cache + blk * stride_db + off * stride_ds + h * stride_dh, d, h < NUM_HEADS, mask,
                          HEAD_DIM, KV_QUANT, MAX)


@triton.jit
def _store_quant_rows(src, row, d, head_mask, mask, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr,
                      MAX: tl.constexpr):
    """[H, D] source rows -> each cache row (pointers `row`): the value bytes, then the scale."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    q, s16 = _quantize(x, KV_QUANT, MAX)
    tl.store(row[:, None] + d[None, :], q.to(row.dtype.element_ty), mask=mask)
    _store_scale(row + HEAD_DIM, s16, head_mask)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v: [T, Hkv, D] (any token/head strides, unit stride in D); caches: [num_blocks,
    block_size, Hkv, D], or [.., D + 2] int8/uint8 rows that are quantized on the way in
    (kernels/kv_quant.py); slot_mapping: [T] flat slot block * block_size + offset (int32/int64)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    quant = kv_quant_of(k_cache)
    if quant:
        check_row_width(k_cache, head_dim, quant)
        _launch(_store_quant_kernel, k, v, k_cache, v_cache, slot_mapping, KV_QUANT=quant, MAX=MAX_VALUE[quant])
    else:
        _launch(_store_kv_kernel, k, v, k_cache, v_cache, slot_mapping)


def _launch(kernel, k, v, k_cache, v_cache, slot_mapping, **constants) -> None:
    """One program per token, plain or quantizing: the same strides and tiles."""
    num_tokens, num_heads, head_dim = k.shape
    kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim), num_warps=4 if num_heads * head_dim >= 1024 else 1,
        **constants)
