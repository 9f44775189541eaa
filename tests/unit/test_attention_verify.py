"""The batched verification path of the torch backend equals attending each span as a prefill
chunk over its cached prefix (the path the exactness tests cover against transformers)."""
import pytest
import torch

from cluster.model.attention import AttentionBatch, PrefillSpan, TorchAttentionBackend


def _spans(lengths, query_lens, block_size, num_blocks, gen):
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spans, slots, start = [], [], 0
    for ctx, q in zip(lengths, query_lens):
        n = -(-ctx // block_size)
        table = tuple(perm[:n])
        perm = perm[n:]
        spans.append(PrefillSpan(start, q, ctx, table))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx)]
        start += q
    return spans, torch.tensor(slots)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)])
def test_verify_equals_prefill_spans(window, heads):
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, bs, nb = *heads, 16, 4, 40
    lengths, query_lens = [9, 4, 17, 1, 8], [3, 4, 5, 1, 1]
    spans, slots = _spans(lengths, query_lens, bs, nb, gen)
    t = sum(query_lens)
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    cache = torch.randn(2, nb, bs, hkv, d, generator=gen)
    backend = TorchAttentionBackend(hq, hkv, d, torch.device("cpu"))
    outs = []
    for field in ("verifies", "prefills"):
        kc, vc = cache[0].clone(), cache[1].clone()
        spans_by_field = {"verifies": (), "prefills": (), field: tuple(spans)}
        batch = AttentionBatch(num_decode=0, decode_context_lens=(), decode_block_tables=(),
                               slot_mapping=slots, block_size=bs, **spans_by_field)
        outs.append(backend.forward(q, k, v, kc, vc, window, backend.prepare(batch)))
    torch.testing.assert_close(outs[0], outs[1])
