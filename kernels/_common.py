"""Pieces every attention kernel shares: the row packing of GQA queries, one key tile of online
softmax over the paged cache, and a key range split into masked and unmasked segments.

Row packing: a tile's BLOCK_M rows are (query token, query head) pairs of ONE KV head, row r
being query r // GROUP and head r % GROUP of that KV head's group. Every row of the tile reads
the same K/V, so a K/V tile is loaded once for the whole group (GQA/MQA without repeating KV),
and a single decode token of an MQA model still fills a tensor-core tile of 16+ rows.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_quant import _dequantize, _load_scale

# A constexpr, not a float: a @jit function may read only constexpr globals (a plain float
# passes the interpreter and fails the compiler: tests/kernels/test_compile.py guards it).
LOG2E = tl.constexpr(1.4426950408889634)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors, one program at a time)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def head_block(head_dim: int) -> int:
    """tl.dot needs K >= 16; head dims like 80 or 96 are padded to the next power of two."""
    return max(16, next_pow2(head_dim))


def dot_flags(dtype: torch.dtype) -> tuple[str | None, bool]:
    """(input precision, upcast). fp32 stays IEEE (tf32 would break exactness against torch);
    16-bit inputs keep the target's default (tensor cores). The interpreter's bf16 tl.dot is
    wrong, so there bf16 operands are upcast to fp32 first."""
    precision = "ieee" if dtype == torch.float32 else None
    return precision, bool(dtype == torch.bfloat16 and interpreting())


def autotune_configs(space: list[dict], interp_config: dict) -> list[triton.Config]:
    """The search space on GPUs; one fixed config under the interpreter, where the autotuner
    cannot time anything and every extra config would only cost minutes."""
    if interpreting():
        space = [interp_config]
    out = []
    for entry in space:
        entry = dict(entry)
        warps, stages = entry.pop("num_warps", 4), entry.pop("num_stages", 2)
        out.append(triton.Config(entry, num_warps=warps, num_stages=stages))
    return out


def fp32_pruner(fp32_space: list[dict]):
    """An `early_config_prune` for triton.autotune: fp32 launches (IEEE dots, PRECISION="ieee")
    get a space of their own. Their tiles hold twice the bytes of a 16-bit tile with no tensor
    cores to take them, and at head dim 128 every config of the 16-bit spaces spilled (0.5-20 KB
    of stack per thread, up to 100 s of ptxas per config: `python -m kernels.compile_check`)."""
    fp32 = autotune_configs(fp32_space, fp32_space[0])

    def prune(configs, named_args, **kwargs):
        if interpreting() or kwargs.get("PRECISION") != "ieee":
            return configs
        return fp32
    return prune


@triton.jit
def _load_q_rows(q_ptr, q_start, q_len, row0, kv_head, stride_qt, stride_qh, offs_d, d_mask,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows row0 .. row0+BLOCK_M of one KV head's packed queries. Returns (q tile, query index
    of each row clamped to the span, head of each row, row validity)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    query = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    valid = query < q_len
    query = tl.minimum(query, q_len - 1)   # pad rows mirror the last query: same mask, no NaN
    ptrs = q_ptr + (q_start + query)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh \
        + offs_d[None, :]
    q = tl.load(ptrs, mask=valid[:, None] & d_mask[None, :], other=0.0)
    return q, query, head, valid


@triton.jit
def _tile_update(acc, m_i, l_i, q, k_cache, v_cache, table_row, start_n, ctx, qpos, window,
                 kv_off_k, kv_off_v, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                 offs_n, offs_d, d_mask, tail_row, tab_len,
                 BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr,
                 HAS_TAIL: tl.constexpr):
    """One BLOCK_N tile of keys [start_n, start_n + BLOCK_N) through the block table. Scores are
    kept in log2 units (qk_scale includes log2 e) so exp2 replaces exp. MASK=False is for tiles
    known to be fully visible to every row: no bounds, causal or window checks at all. KV_QUANT
    (kernels/kv_quant.py): 0 reads K/V as stored; int8/fp8 rows are dequantized in registers to
    the query's dtype, the same values as the reference's dequantized copy. HAS_TAIL (a decode
    row of a token tree, kernels/rows.py `tree_tails`): keys from `tab_len` on sit at the flat
    slots `tail_row` lists (the row's path), read in the same tiles as keys through the table."""
    pos = start_n + offs_n
    if MASK:
        in_ctx = pos < ctx
        blk = tl.load(table_row + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        kv_mask = in_ctx[:, None] & d_mask[None, :]
    else:
        blk = tl.load(table_row + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    slot = (pos % BLOCK_SIZE).to(tl.int64)
    if HAS_TAIL:
        in_tail = pos >= tab_len
        flat = tl.load(tail_row + (pos - tab_len), mask=in_tail & (pos < ctx), other=0).to(tl.int64)
        blk = tl.where(in_tail, flat // BLOCK_SIZE, blk)
        slot = tl.where(in_tail, flat % BLOCK_SIZE, slot)
    if KV_QUANT == 0:
        k = tl.load(k_cache + kv_off_k + blk[:, None] * stride_kb + slot[:, None] * stride_ks + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_cache + kv_off_v + blk[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :],
                    mask=kv_mask, other=0.0)
    else:
        rows = pos < ctx   # the scales' row mask (always true in unmasked tiles: one compare a row)
        k = _load_quant_rows(k_cache + kv_off_k + blk * stride_kb + slot * stride_ks, offs_d, kv_mask, rows,
                             q.dtype, HEAD_DIM, KV_QUANT)
        v = _load_quant_rows(v_cache + kv_off_v + blk * stride_vb + slot * stride_vs, offs_d, kv_mask, rows,
                             q.dtype, HEAD_DIM, KV_QUANT)
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = s * qk_scale
    if MASK:
        allowed = in_ctx[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > qpos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)   # P@V in the cache dtype (tensor cores), accumulated in fp32
    if UPCAST:
        acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None], input_precision=PRECISION)
    else:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_range(acc, m_i, l_i, q, k_cache, v_cache, table_row, lo, hi, ctx, qpos, qpos_min, qpos_max,
                  window, kv_off_k, kv_off_v, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                  offs_n, offs_d, d_mask, tail_row, tab_len,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr,
                  HAS_TAIL: tl.constexpr):
    """Keys [lo, hi) in three segments: masked tiles at the window's edge, unmasked tiles every
    row sees in full (the bulk of a long context), masked tiles at the causal diagonal/the end.
    Requires hi <= ctx and hi <= qpos_max + 1."""
    full_lo = lo
    if HAS_WINDOW:   # keys >= qpos_max - window + 1 are inside every row's window
        edge = qpos_max - window + 1
        full_lo = tl.minimum(tl.maximum(lo, lo + tl.cdiv(edge - lo, BLOCK_N) * BLOCK_N), hi)
    full_end = tl.minimum(qpos_min + 1, hi)   # keys <= qpos_min are causal for every row
    full_hi = full_lo + tl.maximum(full_end - full_lo, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, full_lo, BLOCK_N):
        acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k_cache, v_cache, table_row, start_n, full_lo, qpos,
                                     window, kv_off_k, kv_off_v, stride_kb, stride_ks, stride_vb, stride_vs,
                                     qk_scale, offs_n, offs_d, d_mask, tail_row, tab_len, BLOCK_SIZE, True,
                                     HAS_WINDOW, PRECISION, UPCAST, HEAD_DIM, KV_QUANT, HAS_TAIL)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k_cache, v_cache, table_row, start_n, hi, qpos,
                                     window, kv_off_k, kv_off_v, stride_kb, stride_ks, stride_vb, stride_vs,
                                     qk_scale, offs_n, offs_d, d_mask, tail_row, tab_len, BLOCK_SIZE, False,
                                     HAS_WINDOW, PRECISION, UPCAST, HEAD_DIM, KV_QUANT, HAS_TAIL)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, k_cache, v_cache, table_row, start_n, hi, qpos,
                                     window, kv_off_k, kv_off_v, stride_kb, stride_ks, stride_vb, stride_vs,
                                     qk_scale, offs_n, offs_d, d_mask, tail_row, tab_len, BLOCK_SIZE, True,
                                     HAS_WINDOW, PRECISION, UPCAST, HEAD_DIM, KV_QUANT, HAS_TAIL)
    return acc, m_i, l_i


@triton.jit
def _load_quant_rows(row, offs_d, kv_mask, row_mask, dtype, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr):
    """Quantized K or V rows (pointers `row` [BLOCK_N]) -> [BLOCK_N, BLOCK_D] values in `dtype`."""
    raw = tl.load(row[:, None] + offs_d[None, :], mask=kv_mask, other=0)
    scale = _load_scale(row + HEAD_DIM, row_mask)
    return _dequantize(raw, scale, KV_QUANT).to(dtype)
