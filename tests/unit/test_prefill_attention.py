"""The C prefill attention (kernels/cpu/prefill_attn.c) against SDPA with an explicit causal (and
sliding-window) mask, over GQA groups 1-6, head dims 16-256 including ones that are not multiples
of 64, rows strided inside the fused qkv projection, queries that are the tail of a longer context
(a prefix-cache hit or a later chunk), and its chunk invariance: a row gives the same bits however
the prompt is split. And the engine path: the plan selects it, the backend calls it."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from cluster.model.attention import AttentionBatch, PrefillSpan, TorchAttentionBackend
from cluster.model.kernel_plan import AttentionPath, KernelPlan
from kernels import cpu_ops

if cpu_ops.load() is None or not cpu_ops.has_prefill_attention():
    pytest.skip("the C prefill attention is built only with AVX-512", allow_module_level=True)


def _reference(q, k, v, window, scale):
    q_len, ctx = q.shape[0], k.shape[0]
    qpos = torch.arange(ctx - q_len, ctx)[:, None]
    kpos = torch.arange(ctx)[None]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    group = q.shape[1] // k.shape[1]
    heads = [t.float().transpose(0, 1)[None] for t in (q, k, v)]
    o = F.scaled_dot_product_attention(heads[0], heads[1].repeat_interleave(group, 1),
                                       heads[2].repeat_interleave(group, 1), attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def _fused_qkv(ctx, hq, hkv, d, dtype, seed):
    qkv = torch.randn(ctx, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return (qkv[:, :hq * d].view(ctx, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(ctx, hkv, d),
            qkv[:, (hq + hkv) * d:].view(ctx, hkv, d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len,ctx,hq,hkv,d,window", [
    (150, 150, 9, 3, 64, None), (37, 100, 4, 2, 32, None), (1, 70, 8, 8, 128, None),
    (200, 300, 6, 1, 64, 50), (130, 130, 4, 4, 256, 64), (65, 65, 3, 3, 16, None), (40, 90, 2, 1, 80, None)])
def test_prefill_attention_matches_sdpa_and_is_chunk_invariant(dtype, q_len, ctx, hq, hkv, d, window):
    q, k, v = _fused_qkv(ctx, hq, hkv, d, dtype, seed=q_len + ctx)
    q = q[ctx - q_len:]
    got = cpu_ops.prefill_attention(q, k, v, window, d ** -0.5)
    tol = 2e-6 if dtype == torch.float32 else 1e-2     # bf16: the output's own rounding
    torch.testing.assert_close(got.float(), _reference(q, k, v, window, d ** -0.5), rtol=tol, atol=tol)
    for tail in (1, 5, q_len // 2 + 1):                # the last rows as a later chunk of the same prompt
        assert torch.equal(cpu_ops.prefill_attention(q[-tail:], k, v, window, d ** -0.5), got[-tail:])


def test_the_plan_routes_prefill_chunks_to_the_c_kernel(monkeypatch):
    hq, hkv, d, ctx = 6, 2, 64, 40
    plan = KernelPlan.reference(torch.float32)
    backend = TorchAttentionBackend(hq, hkv, d, torch.device("cpu"),
                                    plan=replace(plan, prefill_attention=AttentionPath.FUSED_C))
    sdpa = TorchAttentionBackend(hq, hkv, d, torch.device("cpu"), plan=plan)
    calls = []
    monkeypatch.setattr(cpu_ops, "prefill_attention", lambda *a: calls.append(a) or _real(*a))
    q, k, v = _fused_qkv(ctx, hq, hkv, d, torch.float32, seed=1)
    caches = [torch.zeros(4, 16, hkv, d) for _ in range(2)]
    span = PrefillSpan(query_start=0, query_len=ctx, context_len=ctx, block_table=(0, 1, 2))
    batch = AttentionBatch(num_decode=0, decode_context_lens=(), decode_block_tables=(), prefills=(span,),
                           slot_mapping=torch.arange(ctx), block_size=16)
    got = backend.forward(q, k, v, *caches, None, backend.prepare(batch))
    want = sdpa.forward(q, k, v, *[c.clone() for c in caches], None, sdpa.prepare(batch))
    assert len(calls) == 1
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


_real = cpu_ops.prefill_attention
