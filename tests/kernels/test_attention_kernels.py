"""Decode, verification and prefill attention against their torch references over a sweep of
block sizes, GQA ratios (MHA, GQA, MQA, a non-power-of-two group), head dims, ragged lengths
(1, block boundaries, long enough to split), sliding windows, split partitions and dtypes.
bf16 runs with its dot operands upcast inside the kernel (the interpreter's bf16 tl.dot is wrong).

The sweep is a hand-picked covering set rather than the full product: the interpreter costs
~0.1 s per launch and every value of every axis appears at least once."""
import warnings

import pytest
import torch

from kernel_cases import TOL, paged_batch, spans
from kernels.decode import paged_decode_attention, paged_verify_attention
from kernels.prefill import prefill_attention
from kernels.reference import paged_decode_attention_ref, paged_verify_attention_ref, prefill_attention_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# block_size, query heads, KV heads, head dim, window, dtype, split partition (None: one pass)
CASES = [
    (4, 4, 2, 16, None, F32, None),
    (4, 4, 2, 16, 5, F32, 32),
    (16, 8, 1, 16, None, F16, 32),      # MQA
    (16, 4, 4, 32, 7, BF16, None),      # MHA
    (64, 6, 2, 16, None, F32, 32),      # group of 3; a block holds two key tiles
    (1, 4, 1, 16, 3, F16, 48),          # one token per block; partition not a tile multiple
    (32, 8, 2, 24, 40, BF16, 32),       # head dim padded to 32; window longer than some contexts
    (16, 8, 2, 128, None, F16, 64),     # a real model's head dim
    (8, 12, 4, 64, 9, F32, 32),
    (2, 32, 1, 16, None, F16, None),    # 32 heads on one KV head: verify rows overflow to the prefill kernel
]
IDS = [f"bs{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-w{c[4]}-{str(c[5])[6:]}-p{c[6]}" for c in CASES]


def _lengths(bs):
    return [1, bs, bs + 1, 2 * bs - 1, 37, 70]   # 1, block boundaries, and multi-split contexts


def _close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_decode(case):
    bs, hq, hkv, d, window, dtype, part = case
    lens = _lengths(bs)
    k_cache, v_cache, tables, g = paged_batch(lens, bs, hkv, d, dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, ctx, d ** -0.5, window)
    got = paged_decode_attention(*args, max_context=max(lens), partition_size=part)
    _close(got, paged_decode_attention_ref(*args), dtype)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_verify(case):
    bs, hq, hkv, d, window, dtype, part = case
    qlens = [1, 2, 5, 3, 4, 2]                                     # k + 1, ragged
    lens = [max(n, c) for n, c in zip(qlens, [1, bs, bs + 1, 37, 70, 2])]   # the last: span == sequence
    k_cache, v_cache, tables, g = paged_batch(lens, bs, hkv, d, dtype, seed=1)
    starts, qlen_t = spans(qlens)
    q = torch.randn(sum(qlens), hq, d, generator=g).to(dtype)
    args = (q, k_cache, v_cache, tables, starts, qlen_t, torch.tensor(lens, dtype=torch.int32), max(qlens),
            d ** -0.5, window)
    got = paged_verify_attention(*args, max_context=max(lens), partition_size=part)
    _close(got, paged_verify_attention_ref(*args), dtype)


def test_a_split_reads_no_workspace_lane_it_did_not_write():
    """Head dim 24 pads to 32 lanes: the partitions write whole rows, so a workspace full of inf
    (what a reused buffer may hold; inf times an empty partition's weight 0 is NaN) reaches no
    arithmetic, not even in the padding lanes."""
    bs, hkv, d, lens = 8, 2, 24, [1, 9, 70]
    k_cache, v_cache, tables, g = paged_batch(lens, bs, hkv, d, F32, seed=4)
    q = torch.randn(len(lens), 4, d, generator=g)
    args = (q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), d ** -0.5)
    workspace = (torch.full((4096 * 32,), float("inf")), torch.full((4096,), float("nan")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # numpy's "invalid value" under the interpreter
        got = paged_decode_attention(*args, max_context=max(lens), partition_size=32, workspace=workspace)
    _close(got, paged_decode_attention_ref(*args), F32)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prefill_over_cached_prefix(case):
    bs, hq, hkv, d, window, dtype, _ = case
    qlens = [1, 7, 33, 16, 5]
    cached = [0, 5, 16, bs, 0]      # none, mid-block, tile-aligned, one block
    lens = [c + n for c, n in zip(cached, qlens)]
    k_cache, v_cache, tables, g = paged_batch(lens, bs, hkv, d, dtype, seed=2)
    starts, qlen_t = spans(qlens)
    q = torch.randn(sum(qlens), hq, d, generator=g).to(dtype)
    args = (q, k_cache, v_cache, tables, starts, qlen_t, torch.tensor(lens, dtype=torch.int32), max(qlens),
            d ** -0.5, window)
    _close(prefill_attention(*args), prefill_attention_ref(*args), dtype)


def test_outputs_land_in_strided_rows():
    """The backend hands kernels row slices of q (a view into the fused projection) and of one
    output tensor: results must go to exactly those rows and leave the others untouched."""
    bs, hq, hkv, d = 4, 4, 2, 16
    lens = [3, 9]
    k_cache, v_cache, tables, g = paged_batch(lens, bs, hkv, d, F32, seed=3)
    fused = torch.randn(5, hq + 2 * hkv, d, generator=g)
    q = fused[1:3, :hq]
    out = torch.full((5, hq, d), 7.0)
    ctx = torch.tensor(lens, dtype=torch.int32)
    paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, out=out[1:3])
    want = paged_decode_attention_ref(q.contiguous(), k_cache, v_cache, tables, ctx, 0.25)
    _close(out[1:3], want, F32)
    assert (out[0] == 7).all() and (out[3:] == 7).all()
