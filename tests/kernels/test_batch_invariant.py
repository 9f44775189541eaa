"""Batch-invariant kernels (kernels/batch_invariant.py, TritonAttentionBackend(invariant=True)):
a row's result is bitwise the same whatever else shares the launch, and still the right value."""
import pytest
import torch
import torch.nn.functional as F

from cluster.model.attention import AttentionBatch, TorchAttentionBackend
from cluster.model.ops import _torch_norm_ops
from kernels import cpu_ops
from kernels.backend import TritonAttentionBackend
from kernels.batch_invariant import matmul, rms_norm
from kernels.decode import choose_partition, paged_decode_attention
from test_backend import _run, _step

CLOSE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _bits_per_row(fn, x, sizes):
    """fn on the first m rows of x for each m; every row must equal its value computed alone."""
    alone = [fn(x[i:i + 1]) for i in range(max(sizes))]
    for m in sizes:
        got = fn(x[:m])
        for i in range(m):
            assert torch.equal(got[i:i + 1], alone[i]), f"row {i} of {m} differs from the row alone"
    return torch.cat(alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(24, 40), (50, 70)])   # K, N off the tile sizes (16, 32 interpreted)
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_rows_invariant_and_close(shape, dtype, bias):
    k, n = shape
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(37, 2 * k, generator=g).to(dtype)[:, :k]   # strided rows, as the model's views
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = _bits_per_row(lambda rows: matmul(rows, w, b), x, [1, 5, 16, 37])
    torch.testing.assert_close(got, F.linear(x, w, b), **CLOSE[dtype])


def _norm_case(dtype, rows=19, hidden=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * hidden, generator=g).to(dtype)[:, :hidden]
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    return x, w, res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_fused_c_semantics(dtype):
    x, w, _ = _norm_case(dtype)
    got = _bits_per_row(lambda rows: rms_norm(rows, w, 1e-6), x, [1, 7, 19])
    if dtype == torch.bfloat16 and cpu_ops.load() is not None and cpu_ops.supports(dtype):
        # Same rounding points as the C kernel; the fp32 sum's order differs, which the
        # rounding to bf16 hides (a 1-ulp tie flip would show here, it is that rare).
        assert torch.equal(got, cpu_ops.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(got, _torch_norm_ops(x, w, 1e-6), **CLOSE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_residual(dtype):
    x, w, res = _norm_case(dtype, seed=1)
    got_res = res.clone()
    got = rms_norm(x, w, 1e-6, residual=got_res)
    want_res = res + x   # torch's add: the sum rounded to the dtype
    assert torch.equal(got_res, want_res)
    for i in (0, 11):   # a row alone: the same bits, its residual row the same update
        alone_res = res[i:i + 1].clone()
        assert torch.equal(rms_norm(x[i:i + 1], w, 1e-6, residual=alone_res), got[i:i + 1])
        assert torch.equal(alone_res, want_res[i:i + 1])
    if dtype == torch.bfloat16 and cpu_ops.load() is not None and cpu_ops.supports(dtype):
        c_res = res.clone()
        assert torch.equal(got, cpu_ops.rms_norm(x, w, 1e-6, residual=c_res)) and torch.equal(c_res, got_res)
    torch.testing.assert_close(got, _torch_norm_ops(want_res, w, 1e-6), **CLOSE[dtype])


def _alone(backend, batch, q, k, v, kc, vc, window, row, ctx, table):
    """Token `row` of the flat batch as a one-row decode pass at its position (ctx = position+1)."""
    single = AttentionBatch(num_decode=1, decode_context_lens=(ctx,), decode_block_tables=(table,),
                            verifies=(), prefills=(), slot_mapping=batch.slot_mapping[row:row + 1],
                            block_size=batch.block_size)
    sl = slice(row, row + 1)
    return backend.forward(q[sl], k[sl], v[sl], kc.clone(), vc.clone(), window, backend.prepare(single))


def _tokens(batch):
    """(flat row, context = position + 1, block table) of every token in the batch."""
    out = [(i, n, t) for i, (n, t) in enumerate(zip(batch.decode_context_lens, batch.decode_block_tables))]
    for s in (*batch.verifies, *batch.prefills):
        first = s.context_len - s.query_len
        out += [(s.query_start + j, first + j + 1, s.block_table) for j in range(s.query_len)]
    return out


# Decodes (one past a 256-key partition), a verification span and a prefill chunk over a cached
# prefix. Partition None: the fixed 256; 32: many partitions, most rows with trailing empty ones.
@pytest.mark.parametrize("partition,window", [(None, None), (32, None), (32, 7)])
def test_attention_rows_invariant_and_close(partition, window):
    hq, hkv, d = 4, 2, 16
    batch, q, k, v, cache = _step(4, hq, hkv, d, [9, 300], [(13, 3)], [(20, 7)], seed=3)
    backend = TritonAttentionBackend(hq, hkv, d, torch.device("cpu"), partition_size=partition, invariant=True)
    meta = backend.prepare(batch)
    assert [(s.kind, s.num_rows) for s in meta.sections] == [("decode", q.shape[0])]
    got, kc, vc = _run(backend, batch, q, k, v, cache, window)
    want = _run(TorchAttentionBackend(hq, hkv, d, torch.device("cpu")), batch, q, k, v, cache, window)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
    assert torch.equal(kc, want[1]) and torch.equal(vc, want[2])
    for row, ctx, table in _tokens(batch):
        alone = _alone(backend, batch, q, k, v, kc, vc, window, row, ctx, table)
        assert torch.equal(alone, got[row:row + 1]), f"token {row} (ctx {ctx}) differs alone"


def test_bf16_attention_rows_invariant():
    hq, hkv, d = 4, 1, 16
    batch, q, k, v, cache = _step(4, hq, hkv, d, [5, 70], [(9, 2)], [(12, 4)], seed=4)
    q, k, v, cache = (t.to(torch.bfloat16) for t in (q, k, v, cache))
    backend = TritonAttentionBackend(hq, hkv, d, torch.device("cpu"), partition_size=32, invariant=True)
    got, kc, vc = _run(backend, batch, q, k, v, cache, None)
    want = _run(TorchAttentionBackend(hq, hkv, d, torch.device("cpu")), batch, q, k, v, cache, None)
    torch.testing.assert_close(got, want[0], **CLOSE[torch.bfloat16])
    for row, ctx, table in _tokens(batch):
        assert torch.equal(_alone(backend, batch, q, k, v, kc, vc, None, row, ctx, table), got[row:row + 1])


def test_normal_path_partition_follows_the_batch():
    """Why invariant mode fixes the partition: on a GPU the normal path splits a context only
    while the step has few sequences, and a split changes a row's bits."""
    assert choose_partition(4096, num_seqs=1, num_kv_heads=8, num_sms=132) is not None
    assert choose_partition(4096, num_seqs=64, num_kv_heads=8, num_sms=132) is None
    hq, hkv, d, bs = 4, 2, 16, 4
    batch, q, k, v, cache = _step(bs, hq, hkv, d, [100], [], [], seed=5)
    table = torch.tensor([batch.decode_block_tables[0]], dtype=torch.int32)
    lens = torch.tensor([100], dtype=torch.int32)
    q, kc, vc = q.contiguous(), cache[0], cache[1]   # the row's own K/V is already in the random cache
    one_pass = paged_decode_attention(q, kc, vc, table, lens, d ** -0.5, partition_size=None)
    split = paged_decode_attention(q, kc, vc, table, lens, d ** -0.5, partition_size=64)
    torch.testing.assert_close(split, one_pass, rtol=1e-5, atol=1e-6)
    assert not torch.equal(split, one_pass)
    inv = [paged_decode_attention(q, kc, vc, table, lens, d ** -0.5, max_context=n, invariant=True)
           for n in (100, 600)]   # alone, and as if beside a 600-token context
    assert torch.equal(inv[0], inv[1])
