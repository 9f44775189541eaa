"""Prefill attention over a cached prefix: variable-length causal attention for chunks whose
first tokens (a prefix-cache hit or earlier chunks) are already in the paged cache.

Every key is read through the block table, the chunk's own keys included (stored by `store_kv`
just before), so a prefix hit and a fresh prompt take the same path. Work is cut into tiles of
BLOCK_M packed (query, head) rows of one KV head; a host-built tile map (span, first row) lets
one launch cover ragged spans without padding, heaviest tiles first so the long ones do not
start last (a cheap form of the load balancing FlashAttention's varlen scheduler does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (LOG2E, _attend_range, _load_q_rows, autotune_configs, dot_flags, fp32_pruner, head_block,
                             interpreting)
from kernels.kv_quant import check_row_width, kv_quant_of


def _configs():
    space = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in ((32, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3))]
    return autotune_configs(space, dict(BLOCK_N=32, num_warps=4, num_stages=1))


FP32_SPACE = [dict(BLOCK_N=64, num_warps=8, num_stages=2)]   # with 32-row tiles: 128 registers, no spill


def block_m_for(head_dim: int, dtype: torch.dtype | None = None) -> int:
    """Rows per tile: fixed, not autotuned, because the host-built tile map depends on it. fp32
    tiles are a quarter of the 16-bit ones: 64+ rows spilled at head dim 128 in every config."""
    if interpreting():
        return 32
    if dtype == torch.float32:
        return 32
    return 128 if head_dim <= 128 else 64


def prefill_tiles(query_lens: list[int], context_lens: list[int], group: int, block_m: int) -> list[tuple[int, int]]:
    """(span, first packed row) of every tile, the ones with the most keys to read first."""
    tiles = []
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        rows = n * group
        for r in range(0, rows, block_m):
            last_query = min(r + block_m, rows) // group   # keys a tile reads end at its last query
            tiles.append((ctx - n + last_query, i, r))
    tiles.sort(key=lambda t: -t[0])
    return [(i, r) for _, i, r in tiles]


@triton.autotune(configs=_configs(), key=["BLOCK_M", "BLOCK_D", "BLOCK_SIZE", "GROUP"],
                 prune_configs_by=dict(early_config_prune=fp32_pruner(FP32_SPACE)))
@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, tables, ctx_lens, q_starts, q_lens, tile_map,
                    scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_tab,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_QUANT: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_map + 2 * tile)
    row0 = tl.load(tile_map + 2 * tile + 1)
    q_start = tl.load(q_starts + seq)
    q_len = tl.load(q_lens + seq)
    ctx = tl.load(ctx_lens + seq)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q, query, head, valid = _load_q_rows(q_ptr, q_start, q_len, row0, kv_head, stride_qt, stride_qh, offs_d, d_mask,
                                         GROUP, BLOCK_M)
    first = ctx - q_len   # position of the span's first query
    qpos = first + query
    qpos_min = first + row0 // GROUP
    qpos_max = first + tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(qpos_min - window + 1, 0) // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, k_cache, v_cache, tables + seq.to(tl.int64) * stride_tab,
                                  lo, qpos_max + 1, ctx, qpos, qpos_min, qpos_max, window,
                                  kv_head.to(tl.int64) * stride_kh, kv_head.to(tl.int64) * stride_vh,
                                  stride_kb, stride_ks, stride_vb, stride_vs, scale * LOG2E,
                                  tl.arange(0, BLOCK_N), offs_d, d_mask, tables, ctx,
                                  BLOCK_N, BLOCK_SIZE, HAS_WINDOW, PRECISION, UPCAST, HEAD_DIM, KV_QUANT, False)
    o = acc / l_i[:, None]   # every real row sees at least its own key
    row_tok = (q_start + query).to(tl.int64)
    tl.store(out_ptr + row_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_mask[None, :])


def prefill_attention(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, max_query_len,
                      scale, window=None, tiles=None, out=None, block_m=None):
    """Span i owns q rows query_starts[i] .. + query_lens[i] at positions context_lens[i] -
    query_lens[i] .. context_lens[i] - 1 and attends causally to every earlier position of its
    sequence in the paged cache (its own K/V already stored). `tiles`: an int32 [n, 2] device
    tensor from `prefill_tiles` (built on the host once per step; None builds it here, with a sync)
    for tiles of `block_m` rows (given with `tiles`: the map is only right for the rows it was cut
    for). Returns [T, Hq, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if (tiles is None) != (block_m is None):
        raise ValueError("prefill_attention takes `tiles` and the `block_m` they were cut for together")
    if tiles is None:
        block_m = block_m_for(head_dim, q.dtype)
        tiles = torch.tensor(prefill_tiles(query_lens.tolist(), context_lens.tolist(), group, block_m),
                             dtype=torch.int32, device=q.device).view(-1, 2)
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if tiles.shape[0] == 0:
        return out
    precision, upcast = dot_flags(q.dtype)
    quant = kv_quant_of(k_cache)   # quantized rows: dequantized in registers to q's dtype
    check_row_width(k_cache, head_dim, quant)
    _prefill_kernel[(tiles.shape[0], num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens, query_starts, query_lens, tiles,
        scale, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_block(head_dim), BLOCK_M=block_m,
        BLOCK_SIZE=k_cache.shape[1], HAS_WINDOW=window is not None, PRECISION=precision, UPCAST=upcast,
        KV_QUANT=quant)
    return out
