"""The Triton kernels on a quantized KV cache (`--kv-cache-dtype int8|fp8_e4m3`, the row format of
cluster/kv/kv_quant.py): store_kv writes exactly `quantize_rows`' bytes; decode (split, unsplit,
batch-invariant), verification and prefill over a cached prefix read the rows in place and equal
the torch reference over the dequantized rows (fp32: the existing fp32 tolerance, 2e-5; the
dequantized values are bit-identical, only the summation order differs); the backend equals the
torch backend on a whole step."""
import pytest
import torch
import triton
import triton.language as tl

from cluster.kv.kv_quant import KVCacheDType, dequantize_rows, quantize_rows
from cluster.model.attention import AttentionBatch, PrefillSpan, TorchAttentionBackend
from kernel_cases import TOL, spans
from kernels.backend import TritonAttentionBackend
from kernels.decode import paged_decode_attention, paged_verify_attention
from kernels.kv_quant import _e4m3_bits, _round_half_even, kv_quant_of
from kernels.prefill import prefill_attention
from kernels.reference import paged_decode_attention_ref, paged_verify_attention_ref, prefill_attention_ref
from kernels.store_kv import store_kv

KINDS = [KVCacheDType.INT8, KVCacheDType.FP8_E4M3]


def _rows(g, t, heads, dim, dtype):
    """Rows over eleven decades, one all zero, one whose scale underflows fp16 to 0, one outlier."""
    x = torch.randn(t, heads, dim, generator=g) * torch.logspace(-8, 3, t)[:, None, None]
    x[0] = 0
    x[1] = torch.randn(heads, dim, generator=g) * 1e-30
    x[2, 0, 3] = 500.0
    return x.to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_the_reference_bytes(kind, dtype):
    g = torch.Generator().manual_seed(1)
    heads, dim, t = 3, 24, 20
    qkv = torch.cat([_rows(g, t, heads, dim, dtype), _rows(g, t, heads, dim, dtype)], dim=1)
    k, v = qkv[:, :heads], qkv[:, heads:]   # strided views, as the model hands them over
    slots = torch.randperm(10 * 4, generator=g)[:t]
    slots[5] = -1   # padding: skipped
    k_cache = torch.zeros(10, 4, heads, dim + 2, dtype=kind.arena_dtype)
    v_cache = torch.zeros_like(k_cache)
    store_kv(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, heads, dim + 2)[slots[keep]], quantize_rows(k[keep], kind))
    assert torch.equal(v_cache.view(-1, heads, dim + 2)[slots[keep]], quantize_rows(v[keep], kind))


@triton.jit
def _encode_kernel(x_ptr, e4m3_ptr, rne_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(e4m3_ptr + offs, _e4m3_bits(x).to(tl.uint8))
    tl.store(rne_ptr + offs, _round_half_even(x))


def test_rounding_helpers_are_round_half_even_like_torch():
    """Every E4M3 value, every midpoint between neighbours (the ties) and a float32 step either
    side of them, subnormals included; integer ties for round."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # +0 .. 448
    mids = (values[:-1] + values[1:]) / 2
    x = torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    x = torch.cat([x, -x, torch.arange(-130, 130) + 0.5, torch.randn(256) * 50])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).clamp(-448, 448)
    e4m3, rne = torch.empty(n, dtype=torch.uint8), torch.empty(n)
    _encode_kernel[(1,)](x, e4m3, rne, N=n)
    assert torch.equal(e4m3, x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(rne, torch.round(x))


def _quantized_cache(kind, g, blocks, block_size, heads, dim, dtype):
    """A K and V cache of quantized noise, and the same rows dequantized to `dtype`."""
    kc = quantize_rows(torch.randn(blocks, block_size, heads, dim, generator=g), kind)
    vc = quantize_rows(torch.randn(blocks, block_size, heads, dim, generator=g), kind)
    return kc, vc, dequantize_rows(kc, dtype), dequantize_rows(vc, dtype)


def _tables(g, seqs, width, blocks):
    return torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(seqs)]).int()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_quantized_rows(kind, dtype):
    g = torch.Generator().manual_seed(2)
    kc, vc, kd, vd = _quantized_cache(kind, g, 40, 4, 2, 32, dtype)
    lens = torch.tensor([1, 37, 70], dtype=torch.int32)
    tables = _tables(g, 3, 20, 40)
    q = torch.randn(3, 6, 32, generator=g).to(dtype)
    want = paged_decode_attention_ref(q, kd, vd, tables, lens, 0.2)
    # One pass, split + merge, invariant; bf16 (values cast to it after the scale) split only.
    runs = ((None, False), (64, False), (32, True)) if dtype == torch.float32 else ((64, False),)
    for part, invariant in runs:
        got = paged_decode_attention(q, kc, vc, tables, lens, 0.2, partition_size=part, invariant=invariant)
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
def test_verify_and_prefill_over_a_cached_prefix(kind):
    g = torch.Generator().manual_seed(3)
    kc, vc, kd, vd = _quantized_cache(kind, g, 40, 4, 2, 32, torch.float32)
    tables = _tables(g, 2, 30, 40)
    starts, lens = spans([5, 20])
    ctx = torch.tensor([40, 27], dtype=torch.int32)   # 35 and 7 positions of cached prefix
    q = torch.randn(25, 4, 32, generator=g)
    for window in (None, 16):
        got = prefill_attention(q, kc, vc, tables, starts, lens, ctx, 20, 0.2, window)
        want = prefill_attention_ref(q, kd, vd, tables, starts, lens, ctx, 20, 0.2, window)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    starts, lens = spans([3, 4])
    got = paged_verify_attention(q[:7], kc, vc, tables, starts, lens, ctx, 4, 0.2, partition_size=16)
    want = paged_verify_attention_ref(q[:7], kd, vd, tables, starts, lens, ctx, 4, 0.2)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def _step(bs, hq, hkv, d, kind, seed=0):
    """Decodes, a verification span, a prefill chunk over a cached prefix and a fresh prompt."""
    g = torch.Generator().manual_seed(seed)
    decodes, spans_ = [9, 1, 30], [(13, 3), (20, 7), (12, 12)]   # (context, query) of 1 verify, 2 prefills
    seqs = [(n, 1) for n in decodes] + spans_
    num_blocks = sum(-(-n // bs) for n, _ in seqs) + 2
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for ctx, n in seqs:
        table, pool = tuple(pool[:-(-ctx // bs)]), pool[-(-ctx // bs):]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
    rows, row = [], len(decodes)
    for (ctx, n), table in zip(spans_, tables[len(decodes):]):
        rows.append(PrefillSpan(row, n, ctx, table))
        row += n
    batch = AttentionBatch(num_decode=len(decodes), decode_context_lens=tuple(decodes),
                           decode_block_tables=tuple(tables[:len(decodes)]), verifies=tuple(rows[:1]),
                           prefills=tuple(rows[1:]), slot_mapping=torch.tensor(slots), block_size=bs)
    fused = torch.randn(len(slots), hq + 2 * hkv, d, generator=g)
    cache = quantize_rows(torch.randn(2, num_blocks, bs, hkv, d, generator=g), kind)
    return batch, fused[:, :hq], fused[:, hq:hq + hkv], fused[:, hq + hkv:], cache


@pytest.mark.parametrize("kind", KINDS)
def test_backend_matches_torch_backend_on_a_quantized_cache(kind):
    batch, q, k, v, cache = _step(4, 4, 2, 16, kind)
    assert kv_quant_of(cache) != 0
    results = []
    for backend in (TorchAttentionBackend(4, 2, 16, torch.device("cpu")),
                    TritonAttentionBackend(4, 2, 16, torch.device("cpu"))):
        kc, vc = cache[0].clone(), cache[1].clone()
        results.append((backend.forward(q, k, v, kc, vc, 6, backend.prepare(batch)), kc, vc))
    (want, wk, wv), (got, gk, gv) = results
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)   # the same bytes stored
