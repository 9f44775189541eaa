"""Token trees on the Triton kernels (interpreted on CPU): a tree row (its path's keys at explicit
slots, `tails`) is bit for bit the plain decode row of the same tokens, split or not, invariant
or not; and an engine on the Triton backend verifying trees that hide the right continuation
behind wrong siblings gives transformers' greedy tokens."""
import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig
from cluster.engine import draft_tree
from cluster.engine.engine import LLMEngine
from integration.test_engine_exactness import _check, _prompts, hf_greedy  # noqa: F401 (a fixture)
from integration.test_token_trees_engine import OracleTrees
from kernels.decode import paged_decode_attention
from kernels.rows import tails_tensor, tree_tails

TREE = (-1, -1, 0, 0, 2, 1, 4)


@pytest.mark.parametrize("invariant,partition", [(True, None), (True, 8), (False, 8), (False, None)])
def test_tree_rows_equal_plain_decode_rows(invariant, partition):
    g = torch.Generator().manual_seed(0)
    bs, first, hq, hkv, d, nb = 4, 9, 4, 2, 16, 12
    kc = torch.randn(nb, bs, hkv, d, generator=g)
    vc = torch.randn(nb, bs, hkv, d, generator=g)
    table = torch.randperm(nb, generator=g)[:6].tolist()
    depths = [0, *draft_tree.depths(TREE)]
    q = torch.randn(len(depths), hq, d, generator=g)
    tables = torch.tensor([table] * len(depths), dtype=torch.int32)
    lens = torch.tensor([first + 1 + dep for dep in depths], dtype=torch.int32)
    tails = tails_tensor(tree_tails(first, TREE, table, bs), torch.int32)
    kw = dict(max_context=int(lens.max()), partition_size=partition, invariant=invariant)
    got = paged_decode_attention(q, kc, vc, tables, lens, 0.25, tails=tails, **kw)

    def slot(p):
        return table[p // bs] * bs + p % bs
    for row in range(len(depths)):
        path = [] if row == 0 else draft_tree.path(TREE, row - 1)
        k2, v2 = kc.clone(), vc.clone()
        for j, node in enumerate(path):   # plain decoding would have written the path at its positions
            k2.view(-1, hkv, d)[slot(first + 1 + j)] = kc.view(-1, hkv, d)[slot(first + 1 + node)]
            v2.view(-1, hkv, d)[slot(first + 1 + j)] = vc.view(-1, hkv, d)[slot(first + 1 + node)]
        want = paged_decode_attention(q[row:row + 1], k2, v2, tables[:1], lens[row:row + 1], 0.25, **kw)
        assert torch.equal(got[row], want[0]), f"row {row}"


def test_engine_verifies_trees_on_triton(tiny_model_dir, hf_greedy):
    model = tiny_model_dir("llama")
    prompts = _prompts()[:2]
    from decode.spec.speculator import make_speculator
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", attention_backend="triton",
                                    cache=CacheConfig(block_size=4, num_blocks=256),
                                    speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=5)),
                       speculator_factory=make_speculator)
    assert engine.backend.name == "triton"
    oracle = OracleTrees({tuple(p): hf_greedy("llama", p) for p in prompts}, 384)
    engine.speculator.proposers["ngram"] = oracle
    _check(engine, "llama", prompts, hf_greedy)
    assert oracle.moved > 3, "no accepted node sat away from its slot"
