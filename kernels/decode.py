"""Paged decode attention and speculative verification attention (flash-decoding style).

Both have few queries per sequence (decode: 1; verification: k+1, causal among themselves) over
a long cached context, so parallelism has to come from the context: program (sequence, KV head,
split) attends one partition of the context for every packed query row of that KV head, writes
a partial output and its log-sum-exp, and a second kernel merges the partitions. With one
partition (short contexts, or enough sequences to fill the GPU) the first kernel writes the
output directly and the merge is skipped.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._common import (LOG2E, _attend_range, _load_q_rows, autotune_configs, dot_flags, fp32_pruner,
                             head_block, interpreting, next_pow2)
from kernels.kv_quant import check_row_width, kv_quant_of
from kernels.prefill import prefill_attention

MAX_ROWS = 128   # packed (query, head) rows one program holds; beyond, the prefill kernel tiles them
PART_ALIGN = 256      # partitions are a multiple of every BLOCK_N in the search space


def _configs():
    # A hand-cut space: each config costs a compile (~1 s) the first time a shape is seen.
    space = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
             for n, w, s in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (64, 8, 3))]
    return autotune_configs(space, dict(BLOCK_N=32, num_warps=4, num_stages=1))


FP32_SPACE = [dict(BLOCK_N=64, num_warps=8, num_stages=2)]   # 80-128 registers, no spill at head dim 128


@triton.autotune(configs=_configs(), key=["BLOCK_M", "BLOCK_D", "BLOCK_SIZE", "SPLIT", "IS_DECODE"],
                 prune_configs_by=dict(early_config_prune=fp32_pruner(FP32_SPACE)))
@triton.jit
def _split_kv_kernel(q_ptr, k_cache, v_cache, out_ptr, part_o, part_lse, tables, ctx_lens, q_starts, q_lens,
                     tails, scale, window, part_size, num_splits,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_tab, stride_tail,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_DECODE: tl.constexpr,
                     SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr, KV_QUANT: tl.constexpr, HAS_TAIL: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    if IS_DECODE:
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(q_starts + seq)
        q_len = tl.load(q_lens + seq)
    ctx = tl.load(ctx_lens + seq)
    # A token tree's decode row (IS_DECODE): its last tails[seq, 0] keys at the slots that follow.
    tail_row = tails + seq.to(tl.int64) * stride_tail
    tab_len = ctx
    if HAS_TAIL:
        tab_len = ctx - tl.load(tail_row)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q, query, head, valid = _load_q_rows(q_ptr, q_start, q_len, 0, kv_head, stride_qt, stride_qh, offs_d, d_mask,
                                         GROUP, BLOCK_M)
    qpos = ctx - q_len + query
    qpos_min = ctx - q_len
    qpos_max = ctx - 1
    # This partition's keys, cut to the context and to the earliest row's window.
    lo = split * part_size
    hi = tl.minimum(lo + part_size, ctx)
    if HAS_WINDOW:
        lo = tl.maximum(lo, (qpos_min - window + 1) // BLOCK_N * BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)   # finite: a fully masked tile cannot make NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, k_cache, v_cache, tables + seq.to(tl.int64) * stride_tab,
                                  lo, hi, ctx, qpos, qpos_min, qpos_max, window,
                                  kv_head.to(tl.int64) * stride_kh, kv_head.to(tl.int64) * stride_vh,
                                  stride_kb, stride_ks, stride_vb, stride_vs, scale * LOG2E,
                                  tl.arange(0, BLOCK_N), offs_d, d_mask, tail_row + 1, tab_len,
                                  BLOCK_N, BLOCK_SIZE, HAS_WINDOW, PRECISION, UPCAST, HEAD_DIM, KV_QUANT, HAS_TAIL)
    has = l_i > 0   # a row sees no key of this partition when the partition ends before it starts
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    row_tok = (q_start + query).to(tl.int64)
    if SPLIT:
        base = (row_tok * num_heads + head) * num_splits + split
        # Whole BLOCK_D rows (zeros past HEAD_DIM): the merges read them all, and a padding lane
        # left unwritten held whatever the workspace held (NaN garbage times a weight).
        tl.store(part_o + base[:, None] * BLOCK_D + offs_d[None, :], o, mask=valid[:, None])
        tl.store(part_lse + base, tl.where(has, m_i + tl.math.log2(l_safe), float("-inf")), mask=valid)
    else:
        tl.store(out_ptr + row_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_mask[None, :])


@triton.jit
def _merge_kernel(part_o, part_lse, out_ptr, num_splits, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[t, h] = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse); empty partitions
    carry lse = -inf and weigh nothing."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (tok * tl.num_programs(1) + head) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse + base + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_o + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _ordered_merge_kernel(part_o, part_lse, out_ptr, num_splits, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The batch-invariant merge: partitions one at a time in index order (the max lse, then
    sum_s w_s o_s and sum_s w_s). The step's partition count follows its longest context, but a
    row's empty partitions weigh exactly 0 and add exact zeros to its sums; _merge_kernel's tree
    sum is compiled per BLOCK_S, with no promise of the same grouping for another count."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (tok * tl.num_programs(1) + head) * num_splits
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(part_lse + base)
    for s in range(1, num_splits):
        m = tl.maximum(m, tl.load(part_lse + base + s))
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    den = 0.0
    for s in range(0, num_splits):
        w = tl.math.exp2(tl.load(part_lse + base + s) - m)
        acc += w * tl.load(part_o + (base + s) * BLOCK_D + offs_d)
        den += w
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, (acc / den).to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# Batch-invariant mode: one split-KV config and one partition size whatever the batch, so a row's
# arithmetic never follows the step's shape (the autotuner and `choose_partition` both would).
INVARIANT_PARTITION = PART_ALIGN
INVARIANT_CONFIG = dict(BLOCK_N=32, num_warps=4, num_stages=1) if interpreting() else \
    dict(BLOCK_N=64, num_warps=4, num_stages=2)


def choose_partition(max_context: int, num_seqs: int, num_kv_heads: int, num_sms: int,
                     min_partition: int = 512, align: int = PART_ALIGN) -> int | None:
    """Context partition for split-KV, or None for one pass. Split only while (sequences x KV
    heads) programs leave the GPU under-filled (two waves of SMs), never below `min_partition`
    keys: short partitions make the merge cost more than the parallelism gains."""
    programs = num_seqs * num_kv_heads
    splits = min(triton.cdiv(2 * num_sms, programs), triton.cdiv(max_context, min_partition))
    if splits <= 1:
        return None
    return triton.cdiv(triton.cdiv(max_context, splits), align) * align


def _launch(q, k_cache, v_cache, tables, ctx_lens, q_starts, q_lens, num_seqs, rows, max_context, scale,
            window, partition_size, out, workspace, is_decode, invariant=False, tails=None):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = head_block(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    # Invariant: always split (one partition too), so every row takes the same path to its output.
    split = partition_size is not None and (invariant or partition_size < max_context)
    num_splits = triton.cdiv(max_context, partition_size) if split else 1
    part = partition_size if split else triton.cdiv(max(max_context, 1), PART_ALIGN) * PART_ALIGN
    if split:
        need = num_tokens * num_heads * num_splits
        if workspace is None or workspace[1].numel() < need:
            workspace = (torch.empty(need * block_d, dtype=torch.float32, device=q.device),
                         torch.empty(need, dtype=torch.float32, device=q.device))
        part_o, part_lse = workspace
    else:
        part_o = part_lse = out   # unused
    precision, upcast = dot_flags(q.dtype)
    quant = kv_quant_of(k_cache)   # quantized rows: dequantized in registers to q's dtype
    check_row_width(k_cache, head_dim, quant)
    # The JIT function under the autotuner with the fixed config: no choice by shape.
    kernel, config = (_split_kv_kernel.fn, INVARIANT_CONFIG) if invariant else (_split_kv_kernel, {})
    kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, tables, ctx_lens, q_starts, q_lens, tables if tails is None else tails,
        scale, window or 0, part, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0), 0 if tails is None else tails.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=max(16, next_pow2(rows * group)),
        BLOCK_SIZE=k_cache.shape[1], IS_DECODE=is_decode, SPLIT=split, HAS_WINDOW=window is not None,
        PRECISION=precision, UPCAST=upcast, KV_QUANT=quant, HAS_TAIL=tails is not None, **config)
    if invariant:
        _ordered_merge_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, num_splits, out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d)
    elif split:
        _merge_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, next_pow2(num_splits)))
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window=None,
                           max_context=None, partition_size=None, out=None, workspace=None, invariant=False,
                           tails=None):
    """q: [B, Hq, D], one query per sequence at position context_lens[b] - 1 (its own K/V already
    stored). block_tables: [B, max_blocks] int32; context_lens: [B] int32. `max_context` (a host
    int, avoids a device sync) and `partition_size` (None: one pass) size the split. `invariant`:
    each row's bits independent of the batch (fixed config, always split by `partition_size`,
    INVARIANT_PARTITION if None, merged in order). `tails`: token-tree rows (int32 [B, 1 + W],
    kernels/rows.py `tree_tails`), their path's keys at explicit slots. Returns [B, Hq, D]."""
    if max_context is None:
        max_context = int(context_lens.max())
    if invariant:
        if q.shape[1] // k_cache.shape[2] > MAX_ROWS:
            raise ValueError(f"batch-invariant decode holds at most {MAX_ROWS} query heads per KV head")
        return _launch(q, k_cache, v_cache, block_tables, context_lens, context_lens, context_lens, q.shape[0], 1,
                       max_context, scale, window, partition_size or INVARIANT_PARTITION, out, workspace, True,
                       invariant=True, tails=tails)
    if q.shape[1] // k_cache.shape[2] > MAX_ROWS:   # more packed rows than one program holds
        if tails is not None:
            raise ValueError(f"token-tree rows hold at most {MAX_ROWS} query heads per KV head")
        ones = torch.ones_like(context_lens)
        return prefill_attention(q, k_cache, v_cache, block_tables, torch.cumsum(ones, 0) - 1, ones, context_lens,
                                 1, scale, window, out=out)
    return _launch(q, k_cache, v_cache, block_tables, context_lens, context_lens, context_lens, q.shape[0], 1,
                   max_context, scale, window, partition_size, out, workspace, True, tails=tails)


def paged_verify_attention(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens,
                           max_query_len, scale, window=None, max_context=None, partition_size=None, out=None,
                           workspace=None):
    """Speculative verification: sequence i owns q rows query_starts[i] .. + query_lens[i] (the
    last accepted token and its drafts) at positions context_lens[i] - query_lens[i] .., causal
    among themselves, over its paged context (their own K/V already stored). Returns [T, Hq, D]."""
    if max_context is None:
        max_context = int(context_lens.max())
    if max_query_len * (q.shape[1] // k_cache.shape[2]) > MAX_ROWS:
        return prefill_attention(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens,
                                 max_query_len, scale, window, out=out)
    return _launch(q, k_cache, v_cache, block_tables, context_lens, query_starts, query_lens, query_lens.shape[0],
                   max_query_len, max_context, scale, window, partition_size, out, workspace, False)


PLANNING_SMS = 132   # the meta device plans for an H100/H200 SXM (the compile check's target)


def default_partition(max_context, num_seqs, num_kv_heads, device) -> int | None:
    """Partition for this device: a small one under the interpreter so tests cover the merge."""
    if interpreting():
        return 64 if max_context > 64 else None
    device = torch.device(device)
    sms = PLANNING_SMS if device.type == "meta" else _num_sms(device.index)
    return choose_partition(max_context, num_seqs, num_kv_heads, sms)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int | None) -> int:   # a device query per step would cost more than the kernel
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count
