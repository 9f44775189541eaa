"""Absorbed-MLA decode attention in Triton: kernels/mla_decode.py's signature and reference.

One program per (row, block of BLOCK_H heads): each tile of BLOCK_N latent vectors is loaded once
for all the program's heads and scored with two dots (compressed part, RoPE part), online softmax
in fp32, the output accumulated in latent space ([BLOCK_H, C]). The latent's halves are read from
the K and V planes of the layer's cache (`plane`: elements between them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import LOG2E, next_pow2


@triton.jit
def _latent_tile(kv, slot, valid, cols, HALF: tl.constexpr, plane, WIDTH: tl.constexpr):
    """[BLOCK_N, len(cols)] latent elements `cols` of the tokens at `slot` (fp32, 0 where invalid)."""
    in_k = cols < HALF
    offs = slot[:, None] * HALF + tl.where(in_k, cols, cols - HALF)[None, :] + tl.where(in_k, 0, plane)[None, :]
    mask = valid[:, None] & (cols < WIDTH)[None, :]
    return tl.load(kv + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _mla_decode_kernel(q_lat, q_pe, kv, tables, lens, out, scale, plane, heads, max_blocks,
                       C: tl.constexpr, P: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    r = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_p = tl.arange(0, BLOCK_P)
    h_ok = offs_h < heads
    ql = tl.load(q_lat + (r * heads + offs_h[:, None]) * C + offs_c[None, :],
                 mask=h_ok[:, None] & (offs_c < C)[None, :], other=0.0).to(tl.float32)
    qp = tl.load(q_pe + (r * heads + offs_h[:, None]) * P + offs_p[None, :],
                 mask=h_ok[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
    length = tl.load(lens + r)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    qk_scale = scale * LOG2E
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < length
        block = tl.load(tables + r * max_blocks + offs_n // BLOCK_SIZE, mask=valid, other=0)
        slot = block * BLOCK_SIZE + offs_n % BLOCK_SIZE
        c = _latent_tile(kv, slot, valid, offs_c, HALF, plane, C)
        pe = _latent_tile(kv, slot, valid, C + offs_p, HALF, plane, C + P)
        s = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(pe))          # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, c)
        m = m_new
    acc = acc / l_sum[:, None]
    tl.store(out + (r * heads + offs_h[:, None]) * C + offs_c[None, :], acc.to(out.dtype.element_ty),
             mask=h_ok[:, None] & (offs_c < C)[None, :])


def mla_decode_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                      lens: torch.Tensor, scale: float) -> torch.Tensor:
    rows, heads, c_dim = q_lat.shape
    p_dim = q_pe.shape[-1]
    q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    out = torch.empty((rows, heads, c_dim), dtype=q_lat.dtype, device=q_lat.device)
    block_h = 16   # tl.dot's smallest M; masked above `heads`
    block_n = 16 if c_dim > 256 else 32   # the C-wide tile and accumulator fit the registers
    grid = (rows, triton.cdiv(heads, block_h))
    _mla_decode_kernel[grid](q_lat, q_pe, kv, tables, lens, out, scale, kv[0].numel(), heads, tables.shape[1],
                             C=c_dim, P=p_dim, HALF=kv.shape[-1], BLOCK_SIZE=kv.shape[2],
                             BLOCK_C=max(16, next_pow2(c_dim)), BLOCK_P=max(16, next_pow2(p_dim)),
                             BLOCK_H=block_h, BLOCK_N=block_n, num_warps=4)
    return out
