"""The quantized KV cache (`--kv-cache-dtype int8|fp8_e4m3`, cluster/kv/kv_quant.py): the C store
writes exactly the reference's bytes; the C decode kernel reading quantized rows in place equals
SDPA over the same rows dequantized (fp32 rounding only); the error of the format itself is bounded;
the layout says what it holds (hash, bytes per block) and an unquantized layout hashes as before."""
import hashlib

import pytest
import torch

from cluster.kv.kv_quant import KVCacheDType, dequantize_rows, quantize_rows, row_width
from cluster.model.attention import AttentionBatch, TorchAttentionBackend
from cluster.types import KVLayout
from kernels import cpu_ops

KINDS = [KVCacheDType.INT8, KVCacheDType.FP8_E4M3]
needs_c = pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler: the fused CPU ops are not built here")


def _rows(g: torch.Generator, t: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows over nine decades of magnitude, one all zero, one with a single outlier."""
    x = torch.randn(t, heads, dim, generator=g) * torch.logspace(-6, 3, t)[:, None, None]
    x[0] = 0
    x[1, 0, 3] = 500.0
    return x.to(dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_round_trip_error_is_bounded(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 64, generator=g)
    packed = quantize_rows(x, kind)
    assert packed.dtype == kind.arena_dtype and packed.shape == (64, 4, row_width(64, kind))
    err = (dequantize_rows(packed, torch.float32) - x).abs()
    step = x.abs().amax(dim=-1, keepdim=True) / kind.max_value
    if kind is KVCacheDType.INT8:          # round to nearest: half a step (and the scale's fp16 rounding)
        assert (err <= step * 0.5 * 1.002 + 1e-7).all()
    else:                                  # E4M3: 3 mantissa bits, relative error <= 2^-4 above the subnormals
        assert (err <= x.abs() * 2 ** -4 + step * 2 ** -9 + 1e-7).all()
    assert torch.equal(dequantize_rows(quantize_rows(torch.zeros(2, 3, 8), kind), torch.float32), torch.zeros(2, 3, 8))


@needs_c
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_store_writes_the_reference_bytes(kind, dtype):
    g = torch.Generator().manual_seed(1)
    heads, dim, t = 3, 64, 37
    qkv = torch.cat([_rows(g, t, heads, dim, dtype), _rows(g, t, heads, dim, dtype)], dim=1).view(t, -1)
    k, v = qkv[:, :heads * dim].view(t, heads, dim), qkv[:, heads * dim:].view(t, heads, dim)   # strided views
    slots = torch.randperm(8 * 16, generator=g)[:t]
    k_cache = torch.zeros(8, 16, heads, dim + 2, dtype=kind.arena_dtype)
    v_cache = torch.zeros_like(k_cache)
    cpu_ops.store_kv(k, v, slots, k_cache, v_cache)
    assert torch.equal(k_cache.view(-1, heads, dim + 2)[slots], quantize_rows(k, kind))
    assert torch.equal(v_cache.view(-1, heads, dim + 2)[slots], quantize_rows(v, kind))


def _caches(g, kind, blocks, block_size, heads, dim, dtype):
    k = quantize_rows(torch.randn(blocks, block_size, heads, dim, generator=g).to(dtype), kind)
    v = quantize_rows(torch.randn(blocks, block_size, heads, dim, generator=g).to(dtype), kind)
    return k, v


@needs_c
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window", [(9, 3, 64, 16, None), (4, 4, 48, 8, 11)])
def test_c_decode_on_quantized_rows_equals_sdpa_on_them_dequantized(kind, dtype, heads, kv_heads, dim, block_size,
                                                                     window):
    g = torch.Generator().manual_seed(heads * dim)
    lens = [1, block_size + 1, 3 * block_size + 7, 70]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_q, v_q = _caches(g, kind, num_blocks, block_size, kv_heads, dim, dtype)
    tables, used = [], 0
    for n in lens:
        tables.append(tuple(range(used, used + -(-n // block_size))))
        used += len(tables[-1])
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    backend = TorchAttentionBackend(heads, kv_heads, dim, torch.device("cpu"))
    batch = AttentionBatch(num_decode=len(lens), decode_context_lens=tuple(lens), decode_block_tables=tuple(tables),
                           prefills=(), slot_mapping=torch.zeros(len(lens), dtype=torch.long), block_size=block_size)
    meta = backend.prepare(batch).decode
    # The reference: SDPA over the rows dequantized in fp32 (the kernel never rounds them to bf16).
    want = backend._decode(q.float(), dequantize_rows(k_q, torch.float32), dequantize_rows(v_q, torch.float32),
                           window, meta)
    got = cpu_ops.decode_attention(q, k_q, v_q, meta.block_table.view(len(lens), -1), meta.lens, window, dim ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else 1e-2      # bf16: the output's own rounding
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # The torch backend's gather path dequantizes the same rows: the same result within bf16 rounding.
    gathered = backend._decode(q, k_q, v_q, window, meta)
    torch.testing.assert_close(gathered.float(), want, rtol=3e-2 if dtype == torch.bfloat16 else 2e-5,
                               atol=3e-2 if dtype == torch.bfloat16 else 2e-5)


@needs_c
@pytest.mark.parametrize("kind", KINDS)
def test_decode_block_on_quantized_cache_equals_the_separate_ops(kind):
    from cluster.model.llama import RotaryTable
    from cluster.model.model_config import RopeConfig
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, bs, b = 6, 2, 64, 16, 3
    rotary = RotaryTable(RopeConfig(kind="default", theta=10000.0), dim, 256)
    k_cache, v_cache = _caches(g, kind, 12, bs, kv_heads, dim, torch.bfloat16)
    qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16)
    positions = torch.tensor([4, 20, 40])
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    slots = tables[torch.arange(b), positions // bs] * bs + positions % bs
    lens = positions + 1
    k2, v2, qkv2 = k_cache.clone(), v_cache.clone(), qkv.clone()
    got = cpu_ops.decode_block(qkv, positions, rotary.cos, rotary.sin, slots, k_cache, v_cache, tables, lens, heads,
                               kv_heads, dim, None, dim ** -0.5)
    cpu_ops.rope_(qkv2, positions, rotary.cos, rotary.sin, heads + kv_heads, dim)
    k = qkv2[:, heads * dim:(heads + kv_heads) * dim].view(b, kv_heads, dim)
    v = qkv2[:, (heads + kv_heads) * dim:].view(b, kv_heads, dim)
    cpu_ops.store_kv(k, v, slots, k2, v2)
    want = cpu_ops.decode_attention(qkv2[:, :heads * dim].view(b, heads, dim), k2, v2, tables, lens, None, dim ** -0.5)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    assert torch.equal(got, want.view(b, -1))


def test_layout_names_its_kv_dtype_and_keeps_old_hashes():
    base = dict(model_id="m", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
    auto, int8, fp8 = KVLayout(**base), KVLayout(**base, kv_dtype="int8"), KVLayout(**base, kv_dtype="fp8_e4m3")
    # The hash from before kv_dtype existed: an unquantized layout still matches an older peer's.
    old = "|".join(f"{k}={v}" for k, v in sorted({**base, "version": 1}.items()))
    assert auto.layout_hash() == hashlib.sha256(old.encode()).hexdigest()[:16]
    assert len({auto.layout_hash(), int8.layout_hash(), fp8.layout_hash()}) == 3
    assert int8.bytes_per_block() == fp8.bytes_per_block() == 2 * 30 * 16 * 3 * 66
    assert auto.bytes_per_block() == 2 * 30 * 16 * 3 * 64 * 2


def test_a_peer_with_another_kv_dtype_is_refused_by_name():
    from cluster.transfer.base import PROTOCOL_VERSION, LayoutMismatch, PeerMetadata, check_compatible
    base = dict(model_id="m", num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
    peer = PeerMetadata("prefill-0", "tcp", PROTOCOL_VERSION, KVLayout(**base), 8, 0, b"")
    wire = PeerMetadata.decode(peer.encode())            # the handshake's msgpack carries the field
    assert wire.layout == peer.layout
    with pytest.raises(LayoutMismatch, match="kv_dtype: local 'int8', peer 'auto'"):
        check_compatible(KVLayout(**base, kv_dtype="int8"), "tcp", wire)
    check_compatible(KVLayout(**base), "tcp", wire)


def test_int4_view_is_the_top_nibble_at_the_middle_of_its_step():
    from cluster.kv.kv_quant import int4_values
    q = torch.arange(-127, 128, dtype=torch.int8)
    view = int4_values(q)
    assert torch.equal(view, torch.tensor([((v >> 4) * 16 + 8) for v in range(-127, 128)], dtype=torch.float32))
    assert (view - q.float()).abs().max() <= 8
    assert len(set(view.tolist())) == 16                   # 4 bits of information


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_through_the_int4_view_equals_sdpa_on_the_view(dtype):
    """QuantSpec's draft reads the target's int8 cache through its int4 view: the C kernel (decode
    and decode_block) against SDPA on the view dequantized; and the view is not the int8 read."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, bs, lens = 6, 2, 64, 16, [5, 40]
    k_q, v_q = _caches(g, KVCacheDType.INT8, 6, bs, kv_heads, dim, dtype)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]])
    q = torch.randn(2, heads, dim, generator=g).to(dtype)
    backend = TorchAttentionBackend(heads, kv_heads, dim, torch.device("cpu"), int4_view=True)
    batch = AttentionBatch(num_decode=2, decode_context_lens=tuple(lens), decode_block_tables=((0, 1, 2), (3, 4, 5)),
                           prefills=(), slot_mapping=torch.zeros(2, dtype=torch.long), block_size=bs)
    meta = backend.prepare(batch).decode
    want = backend._decode(q.float(), dequantize_rows(k_q, torch.float32, int4_view=True),
                           dequantize_rows(v_q, torch.float32, int4_view=True), None, meta)
    lens_t = torch.tensor(lens)
    got = cpu_ops.decode_attention(q, k_q, v_q, tables, lens_t, None, dim ** -0.5, int4_view=True)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(backend._decode(q, k_q, v_q, None, meta).float(), want, rtol=3 * tol, atol=3 * tol)
    full = cpu_ops.decode_attention(q, k_q, v_q, tables, lens_t, None, dim ** -0.5)
    assert not torch.equal(full, got)
    # decode_block under the view stores plain int8 rows (the bytes of the int8 store) and attends
    # through the view.
    from cluster.model.llama import RotaryTable
    from cluster.model.model_config import RopeConfig
    rotary = RotaryTable(RopeConfig(kind="default", theta=10000.0), dim, 256)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = lens_t - 1
    slots = tables[torch.arange(2), positions // bs] * bs + positions % bs
    k2, v2, qkv2 = k_q.clone(), v_q.clone(), qkv.clone()
    got = cpu_ops.decode_block(qkv, positions, rotary.cos, rotary.sin, slots, k_q, v_q, tables, lens_t, heads,
                               kv_heads, dim, None, dim ** -0.5, int4_view=True)
    cpu_ops.rope_(qkv2, positions, rotary.cos, rotary.sin, heads + kv_heads, dim)
    k = qkv2[:, heads * dim:(heads + kv_heads) * dim].view(2, kv_heads, dim)
    v = qkv2[:, (heads + kv_heads) * dim:].view(2, kv_heads, dim)
    cpu_ops.store_kv(k, v, slots, k2, v2)
    assert torch.equal(k_q, k2) and torch.equal(v_q, v2)
    want = cpu_ops.decode_attention(qkv2[:, :heads * dim].view(2, heads, dim), k2, v2, tables, lens_t, None,
                                    dim ** -0.5, int4_view=True)
    assert torch.equal(got, want.view(2, -1))


def test_the_triton_backend_refuses_the_int4_view():
    from cluster.model.attention import make_attention_backend
    with pytest.raises(ValueError, match="int4 view .* not triton"):
        make_attention_backend("triton", 4, 2, 64, torch.device("cpu"), int4_view=True)
    assert make_attention_backend("torch", 4, 2, 64, torch.device("cpu"), int4_view=True).int4_view
