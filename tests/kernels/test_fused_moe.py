"""The Triton fused MoE (kernels/fused_moe.py) under the interpreter against the torch reference
(kernels/moe_reference.py): float32 within rounding, bfloat16 bit for bit (both round the
projection, silu, the product and the weighted output to the dtype, and add a token's experts in
ascending order); Qwen's routing weights in the model's dtype and Mixtral's in float32; experts
left without tokens; and a row's bits do not depend on the rows beside it."""
from __future__ import annotations

import pytest
import torch

from cluster.model.moe import mixtral_topk, softmax_topk
from kernels.fused_moe import align_by_expert, fused_moe
from kernels.moe_reference import fused_moe_reference

E, H, INTER, T = 6, 48, 40, 21


def _weights(dtype):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * INTER, H, generator=g).mul_(0.1).to(dtype),
            torch.randn(E, H, INTER, generator=g).mul_(0.1).to(dtype), torch.randn(T, H, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router", ["qwen", "mixtral"])
def test_fused_moe_equals_the_reference(dtype, router):
    gate_up, down, x = _weights(dtype)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    logits[:, 0] -= 20   # expert 0 gets no token
    ids, w = softmax_topk(logits.to(dtype), 2, True) if router == "qwen" else mixtral_topk(logits, 2)
    ours, ref = fused_moe(x, gate_up, down, ids, w), fused_moe_reference(x, gate_up, down, ids, w)
    if dtype == torch.bfloat16:
        assert torch.equal(ours, ref)
    else:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_moe(x[5:12], gate_up, down, ids[5:12], w[5:12]), ours[5:12])   # batch-invariant


def test_alignment_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])
    slots, block_expert = align_by_expert(ids, 4, block_m=4)
    # expert 0: pairs 1, 5; expert 1: pair 3; expert 2: pairs 0, 2, 4; padding is 6 (the pair count)
    assert slots.tolist()[:12] == [1, 5, 6, 6, 3, 6, 6, 6, 0, 2, 4, 6]
    assert block_expert.tolist()[:3] == [0, 1, 2] and all(e == 4 for e in block_expert.tolist()[3:])
