"""TritonAttentionBackend equals the engine's torch reference backend on whole steps: decodes,
verification spans and prefill chunks over cached prefixes in one flat batch, with sequences
sharing prefix blocks, through the same prepare/forward protocol the model calls per layer."""
import pytest
import torch

from cluster.model.attention import AttentionBatch, PrefillSpan, TorchAttentionBackend, make_attention_backend
from kernels.backend import TritonAttentionBackend


def _step(bs, hq, hkv, d, decodes, verifies, prefills, seed=0):
    """decodes: context lens; verifies/prefills: (context len, query len). Sequences 0 of each
    kind share their first two blocks. Returns the batch, q/k/v and a cache pair."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(n, 1) for n in decodes] + list(verifies) + list(prefills)
    num_blocks = sum(-(-n // bs) for n, _ in seqs) + 4
    pool = torch.randperm(num_blocks, generator=g).tolist()
    shared, pool = pool[:2], pool[2:]
    tables, slots = [], []
    for i, (ctx, n) in enumerate(seqs):
        need = -(-ctx // bs)
        prefix = shared if i in (0, len(decodes), len(decodes) + len(verifies)) and ctx - n >= 2 * bs else []
        table = tuple(prefix) + tuple(pool[:need - len(prefix)])
        pool = pool[need - len(prefix):]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
    spans, row = [], len(decodes)
    for (ctx, n), table in zip(seqs[len(decodes):], tables[len(decodes):]):
        spans.append(PrefillSpan(row, n, ctx, table))
        row += n
    batch = AttentionBatch(num_decode=len(decodes), decode_context_lens=tuple(decodes),
                           decode_block_tables=tuple(tables[:len(decodes)]),
                           verifies=tuple(spans[:len(verifies)]), prefills=tuple(spans[len(verifies):]),
                           slot_mapping=torch.tensor(slots), block_size=bs)
    t = len(slots)
    fused = torch.randn(t, hq + 2 * hkv, d, generator=g)   # q, k, v as strided views, like the model's
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g)
    return batch, fused[:, :hq], fused[:, hq:hq + hkv], fused[:, hq + hkv:], cache


def _run(backend, batch, q, k, v, cache, window):
    kc, vc = cache[0].clone(), cache[1].clone()
    out = backend.forward(q, k, v, kc, vc, window, backend.prepare(batch))
    return out, kc, vc


STEPS = {
    "mixed": ([9, 4, 1, 70], [(13, 3), (8, 1), (5, 5)], [(20, 7), (6, 6), (40, 33)]),
    "decode_only": ([17, 16, 3, 66], [], []),
    "verify_only": ([], [(30, 5), (9, 2)], []),
    "prefill_only": ([], [], [(12, 12), (37, 4)]),
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)])
@pytest.mark.parametrize("step", list(STEPS))
def test_backend_matches_torch_backend(step, heads, window):
    hq, hkv = heads
    batch, q, k, v, cache = _step(4, hq, hkv, 16, *STEPS[step])
    want = _run(TorchAttentionBackend(hq, hkv, 16, torch.device("cpu")), batch, q, k, v, cache, window)
    got = _run(TritonAttentionBackend(hq, hkv, 16, torch.device("cpu")), batch, q, k, v, cache, window)
    assert got[0].shape == want[0].shape == (q.shape[0], hq * 16)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])   # the stored K/V too


def test_wide_verification_overflows_to_prefill_kernel():
    """(k+1) x heads-per-KV-head above one program's rows: the backend plans the prefill kernel."""
    batch, q, k, v, cache = _step(4, 40, 1, 16, [5], [(30, 5), (9, 4)], [(10, 3)])
    triton_backend = TritonAttentionBackend(40, 1, 16, torch.device("cpu"))
    assert [s.kind for s in triton_backend.prepare(batch).sections] == ["decode", "prefill", "prefill"]
    want = _run(TorchAttentionBackend(40, 1, 16, torch.device("cpu")), batch, q, k, v, cache, None)
    got = _run(triton_backend, batch, q, k, v, cache, None)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)


def test_registry_builds_triton_backend():
    backend = make_attention_backend("triton", 4, 2, 16, torch.device("cpu"))
    assert backend.name == "triton"
