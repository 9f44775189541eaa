"""Fused mixture-of-experts for CUDA in Triton: the signature of kernels/moe_reference.py.

The (token, slot) pairs are sorted by expert on the device and each expert's run padded to
BLOCK_M, so every M-tile of a program belongs to one expert (vLLM's moe_align_block_size, in
torch ops here): no host sync, no per-expert launch, so a CUDA graph can hold it. Two kernels:
gate_up with SiLU-times-up fused into its epilogue (the [pairs, 2I] projection never reaches
memory), then down with the routing weight fused, each pair's row written to its own slot; the k
slots of a token are then added in ascending expert order, as the reference adds them.

One tile config for every shape, K reduced in order with no split: a row's arithmetic depends on
its own data only, so the kernel is batch-invariant as it stands (`fused_moe_invariant`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_flags, interpreting
from kernels.batch_invariant import _rne_bits, _round

_CONFIG = ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1} if interpreting()
           else {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3})


@triton.jit
def _tile_dot(x, w, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SUM_DOT: tl.constexpr):
    if UPCAST:
        x, w = x.to(tl.float32), w.to(tl.float32)
    if SUM_DOT:   # the interpreter: products summed row by row (batch_invariant.matmul says why)
        return acc + tl.sum(x.to(tl.float32)[:, :, None] * tl.trans(w).to(tl.float32)[None, :, :], 1)
    return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_experts, K, inter,
                    stride_xm, stride_we, stride_wn, stride_am, TOP_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, RNE_BITS: tl.constexpr, SUM_DOT: tl.constexpr):
    """act[slot] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T) for one tile of sorted slots."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:   # a tile past the last expert's padded run
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + slots)
    valid = pairs < num_pairs
    rows = (pairs // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < inter
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w_base + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w_base + (inter + offs_n)[:, None].to(tl.int64) * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_g = _tile_dot(x, tl.load(gate_rows + (k0 + offs_k)[None, :], mask=w_mask, other=0.0), acc_g,
                          PRECISION, UPCAST, SUM_DOT)
        acc_u = _tile_dot(x, tl.load(up_rows + (k0 + offs_k)[None, :], mask=w_mask, other=0.0), acc_u,
                          PRECISION, UPCAST, SUM_DOT)
    dtype: tl.constexpr = act_ptr.dtype.element_ty
    # Rounded as torch rounds: the projection, silu(gate), then the product, each to the dtype.
    g = _round(acc_g, dtype, RNE_BITS).to(tl.float32)
    u = _round(acc_u, dtype, RNE_BITS).to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), dtype, RNE_BITS).to(tl.float32)
    tl.store(act_ptr + slots[:, None].to(tl.int64) * stride_am + offs_n[None, :], _round(silu * u, dtype, RNE_BITS),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, topk_w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_experts, K, N,
                 stride_am, stride_we, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, RNE_BITS: tl.constexpr, SUM_DOT: tl.constexpr):
    """out[pair] = (act[slot] @ down[e].T) * routing weight, for one tile of sorted slots."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + slots)
    valid = pairs < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    a_rows = act_ptr + slots[:, None].to(tl.int64) * stride_am
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        acc = _tile_dot(a, tl.load(w_rows + (k0 + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0),
                        acc, PRECISION, UPCAST, SUM_DOT)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    weight = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    y = _round(acc, dtype, RNE_BITS).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :], _round(y, dtype, RNE_BITS),
             mask=valid[:, None] & n_mask[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots: the flat pair index at each padded sorted position, num_pairs for padding;
    block_expert: the expert of each BLOCK_M tile, num_experts past the last run). Device ops
    only; the sizes follow from the shapes (at most cdiv(pairs, BLOCK_M) + min(E, pairs) tiles)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat.index_select(0, order)
    dest = (pad_ends - padded).index_select(0, expert_of) + torch.arange(n, device=flat.device) \
        - starts.index_select(0, expert_of)
    tiles = triton.cdiv(n, block_m) + min(num_experts, n)
    slots = torch.full((tiles * block_m,), n, dtype=torch.int64, device=flat.device)
    slots.index_copy_(0, dest, order)
    tile_starts = torch.arange(tiles, device=flat.device) * block_m
    block_expert = torch.searchsorted(pad_ends, tile_starts, right=True).to(torch.int32)
    return slots, block_expert


def fused_moe(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    """hidden [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_ids [T, k]; topk_weights [T, k]
    -> [T, H] in hidden's dtype (kernels/moe_reference.py's contract)."""
    t, k = topk_ids.shape
    num_experts, h, inter = down.shape
    cfg = dict(_CONFIG)
    bm = cfg["BLOCK_M"]
    hidden, gate_up, down = hidden.contiguous(), gate_up.contiguous(), down.contiguous()
    slots, block_expert = align_by_expert(topk_ids, num_experts, bm)
    act = torch.empty((slots.numel(), inter), dtype=hidden.dtype, device=hidden.device)
    per_pair = torch.empty((t * k, h), dtype=hidden.dtype, device=hidden.device)
    precision, upcast = dot_flags(hidden.dtype)
    flags = {"PRECISION": precision, "UPCAST": upcast, "RNE_BITS": _rne_bits(hidden.dtype), "SUM_DOT": interpreting(),
             **cfg}
    tiles = block_expert.numel()
    _gate_up_kernel[(tiles, triton.cdiv(inter, cfg["BLOCK_N"]))](
        hidden, gate_up, act, slots, block_expert, t * k, num_experts, h, inter,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), TOP_K=k, **flags)
    _down_kernel[(tiles, triton.cdiv(h, cfg["BLOCK_N"]))](
        act, down, topk_weights.contiguous(), per_pair, slots, block_expert, t * k, num_experts, inter, h,
        act.stride(0), down.stride(0), down.stride(1), per_pair.stride(0), **flags)
    # Each token's k outputs added in ascending expert order, rounding after each add (the reference's order).
    ranked = torch.argsort(topk_ids, dim=1, stable=True)
    per_pair = per_pair.view(t, k, h).gather(1, ranked[:, :, None].expand(t, k, h))
    out = per_pair[:, 0].clone()
    for j in range(1, k):
        out += per_pair[:, j]
    return out


# One fixed tile config and no split of K: already batch-invariant (see the module's docstring).
fused_moe_invariant = fused_moe
