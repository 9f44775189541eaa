"""Token trees: the greedy tree rule against brute force, leaf choice by expected gain, the
kernels' tree rows against plain decode rows of the same path (bit for bit in the C kernel, with
int8 rows too), and the SDPA path's tree masks."""
import random

import pytest
import torch

from cluster.engine import draft_tree
from cluster.engine.speculation import Draft
from cluster.kv.kv_quant import KVCacheDType, quantize_rows
from cluster.model.attention import AttentionBatch, PrefillSpan, TorchAttentionBackend
from decode.spec.acceptance import accept_greedy_tree
from decode.spec.tree import Alternative, add_leaves
from kernels import cpu_ops
from kernels.rows import tails_tensor, tree_tails

TREE = (-1, -1, 0, 0, 2, 1, 4)          # two roots' children, branching under node 0, a chain below node 2


def _brute_force(best, tokens, parents):
    """Every root-to-node path whose tokens equal the target's, the longest wins."""
    longest = []
    for node in range(len(tokens)):
        path = draft_tree.path(parents, node)
        rows = [0, *(n + 1 for n in path)]
        if all(tokens[n] == best[r] for n, r in zip(path, rows)):
            longest = max(longest, path, key=len)
    row = longest[-1] + 1 if longest else 0
    return [tokens[n] for n in longest] + [best[row]]


def test_greedy_tree_rule_equals_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        parents, tokens = [], []
        for i in range(n):
            p = rng.randint(-1, i - 1)
            taken = {tokens[j] for j in range(i) if parents[j] == p}
            tokens.append(rng.choice([t for t in range(6) if t not in taken] or [99 + i]))
            parents.append(p)
        draft_tree.check(tuple(tokens), tuple(parents))
        best = [rng.randrange(6) for _ in range(n + 1)]
        logits = torch.full((n + 1, 100 + n), -5.0)
        logits[torch.arange(n + 1), torch.tensor(best)] = 5.0
        got = accept_greedy_tree(logits, tuple(tokens), tuple(parents))
        assert got == _brute_force(best, tokens, parents)
        nodes = draft_tree.accepted_nodes(tuple(tokens), tuple(parents), got[:-1])
        assert [tokens[n] for n in nodes] == got[:-1]


def test_tree_shape_is_checked():
    with pytest.raises(ValueError, match="parents come first"):
        draft_tree.check((1, 2), (1, -1))
    with pytest.raises(ValueError, match="repeats its sibling"):
        draft_tree.check((1, 1), (-1, -1))
    with pytest.raises(ValueError, match="one parent per token"):
        draft_tree.check((1, 2), (-1,))


def test_compaction_moves_the_accepted_path_down_in_order():
    # Accepted nodes 1 (depth 1) and 5 (depth 2): written at start+2 and start+6.
    assert draft_tree.compaction(10, [1, 5]) == [(12, 11), (16, 12)]
    assert draft_tree.compaction(10, [0, 2]) == [(13, 12)]
    assert draft_tree.compaction(10, [0, 1]) == []


def test_leaves_go_where_the_expected_gain_is_highest():
    sure = Draft((5, 6, 7), confidences=(0.95, 0.9, 0.5))
    unsure = Draft((8, 9), confidences=(0.4, 0.9))
    alts = [[Alternative(1, 0.04), Alternative(2, 0.08), Alternative(3, 0.45)],
            [Alternative(4, 0.5), Alternative(5, 0.05)]]
    out = add_leaves([sure, unsure], alts, rooms=[3, 3], budget=2, min_gain=0.05)
    # Gains: sure 0.04, 0.076, 0.385; unsure 0.5, 0.02. The best two: unsure@0 and sure@2.
    assert out[0].tokens == (5, 6, 7, 3) and out[0].parents == (-1, 0, 1, 1)
    assert out[1].tokens == (8, 9, 4) and out[1].parents == (-1, 0, -1)
    for d in out:
        draft_tree.check(d.tokens, d.parents)
    # No room, no budget, or a gain below the bar: the chains come back as they were.
    assert add_leaves([sure, unsure], alts, rooms=[0, 0], budget=4, min_gain=0.05) == [sure, unsure]
    assert add_leaves([sure, unsure], alts, rooms=[3, 3], budget=0, min_gain=0.05) == [sure, unsure]
    assert add_leaves([sure, unsure], alts, rooms=[3, 3], budget=4, min_gain=0.6) == [sure, unsure]


def _tree_case(dtype, kv: KVCacheDType, block_size=4, first=9, seed=0):
    """A cache, one sequence's table, a tree verification at `first` (its K/V already stored at
    slots first.. in node order), and for each row the plain-decode view: a second cache holding
    the row's path at the positions of its depths."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, nb = 6, 2, 64, 16
    k = torch.randn(nb * block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(nb * block_size, hkv, d, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:8].tolist()
    q = torch.randn(1 + len(TREE), hq, d, generator=g).to(dtype)
    return hq, hkv, d, k, v, table, q


def _cache(rows, kv, nb, bs, hkv, d):
    if kv is KVCacheDType.AUTO:
        return rows.view(nb, bs, hkv, d)
    return quantize_rows(rows, kv).view(nb, bs, hkv, -1)


def _slot(table, p, bs):
    return table[p // bs] * bs + p % bs


@pytest.mark.parametrize("dtype,kv", [(torch.float32, KVCacheDType.AUTO), (torch.bfloat16, KVCacheDType.AUTO),
                                      (torch.float32, KVCacheDType.INT8)])
def test_c_kernel_tree_rows_equal_plain_decode_rows(dtype, kv):
    if cpu_ops.load() is None:
        pytest.skip("no C compiler")
    bs, first = 4, 9
    hq, hkv, d, k, v, table, q = _tree_case(dtype, kv, bs, first)
    nb = k.shape[0] // bs
    kc, vc = _cache(k, kv, nb, bs, hkv, d), _cache(v, kv, nb, bs, hkv, d)
    depths = [0, *draft_tree.depths(TREE)]
    tables = torch.tensor([table] * len(depths))
    lens = torch.tensor([first + 1 + dep for dep in depths])
    tails = tails_tensor(tree_tails(first, TREE, table, bs))
    got = cpu_ops.decode_attention(q, kc, vc, tables, lens, None, 0.125, tails=tails)
    for row in range(len(depths)):
        # Plain decoding of this row's path: the path's K/V at the slots of its positions.
        path = [] if row == 0 else draft_tree.path(TREE, row - 1)
        k2, v2 = kc.clone(), vc.clone()
        flat_k, flat_v = k2.view(nb * bs, hkv, -1), v2.view(nb * bs, hkv, -1)
        for j, node in enumerate(path):
            src, dst = _slot(table, first + 1 + node, bs), _slot(table, first + 1 + j, bs)
            flat_k[dst], flat_v[dst] = kc.view(nb * bs, hkv, -1)[src], vc.view(nb * bs, hkv, -1)[src]
        want = cpu_ops.decode_attention(q[row:row + 1], k2, v2, tables[:1], lens[row:row + 1], None, 0.125)
        assert torch.equal(got[row], want[0]), f"row {row}"


@pytest.mark.parametrize("window", [None, 6])
def test_sdpa_tree_rows_see_their_path_only(window):
    """The torch reference (no C kernel): a tree span beside a chain span, each tree row against
    a chain of its own path through the same backend."""
    bs, first = 4, 9
    hq, hkv, d, k, v, table, q = _tree_case(torch.float32, KVCacheDType.AUTO, bs, first, seed=1)
    nb = k.shape[0] // bs
    backend = TorchAttentionBackend(hq, hkv, d, torch.device("cpu"))
    n = 1 + len(TREE)
    span = PrefillSpan(0, n, first + n, tuple(table), TREE)
    slots = torch.tensor([_slot(table, first + i, bs) for i in range(n)])
    knew, vnew = k[:n].clone(), v[:n].clone()
    kc, vc = k.view(nb, bs, hkv, d).clone(), v.view(nb, bs, hkv, d).clone()
    batch = AttentionBatch(0, (), (), (), slots, bs, verifies=(span,))
    got = backend.forward(q, knew, vnew, kc, vc, window, backend.prepare(batch)).view(n, hq, d)
    for row in range(n):
        path = [] if row == 0 else draft_tree.path(TREE, row - 1)
        rows = [0, *(p + 1 for p in path)]
        chain = PrefillSpan(0, len(rows), first + len(rows), tuple(table))
        cslots = torch.tensor([_slot(table, first + i, bs) for i in range(len(rows))])
        kc2, vc2 = k.view(nb, bs, hkv, d).clone(), v.view(nb, bs, hkv, d).clone()
        out = backend.forward(q[rows], knew[rows], vnew[rows], kc2, vc2, window,
                              backend.prepare(AttentionBatch(0, (), (), (), cslots, bs, verifies=(chain,))))
        torch.testing.assert_close(got[row], out.view(len(rows), hq, d)[-1])


def test_ngram_tree_merges_every_occurrence_most_recent_first():
    from decode.spec.ngram import NgramProposer
    p = NgramProposer(2, 4)
    history = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3, 4, 7, 1, 2, 3]
    assert p.propose(history, 3) == [4, 7, 1]
    tokens, parents = p.propose_tree(history, 3, 8)
    # The most recent continuation is the chain; the others branch where they part from it.
    assert (tokens, parents) == ([4, 7, 1, 5, 6, 1, 9, 1], [-1, 0, 1, -1, 3, 4, 0, 6])
    draft_tree.check(tuple(tokens), tuple(parents))
    assert p.propose_tree(history, 3, 4) == ([4, 7, 1, 5], [-1, 0, 1, -1])   # the size bounds it
    assert p.propose_tree(history, 3, 3) == ([4, 7, 1], [-1, 0, 1])         # no room: the chain
    assert p.propose_tree([1, 2, 3], 3, 8) == ([], [])
