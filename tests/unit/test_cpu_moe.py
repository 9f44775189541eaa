"""The CPU mixture-of-experts paths (kernels/cpu_moe.py) against the torch reference with the C
linear as its GEMM (kernels/moe_reference.py): the one-call C kernel and the grouped loop give the
same bits in float32 and bfloat16, with Qwen's and Mixtral's weight dtypes, experts without
tokens, an expert with many rows (prefill) and strided input rows."""
from __future__ import annotations

import pytest
import torch

from cluster.model.moe import mixtral_topk, softmax_topk
from kernels import cpu_moe, cpu_ops
from kernels.moe_reference import fused_moe_reference

pytestmark = pytest.mark.skipif(cpu_ops.load() is None or not cpu_ops.has_moe_experts(),
                                reason="the C MoE kernel needs parallel.cpp built (a C++ compiler and torch's headers)")

E, H, INTER = 8, 96, 80


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router", ["qwen", "mixtral"])
@pytest.mark.parametrize("tokens", [1, 8, 70])
def test_c_kernel_equals_the_reference_bit_for_bit(dtype, router, tokens):
    g = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g) * 0.1).to(dtype)
    down = (torch.randn(E, H, INTER, generator=g) * 0.1).to(dtype)
    x = torch.randn(tokens, 2 * H, generator=g).to(dtype)[:, :H]   # strided rows, as a view of a wider tensor
    logits = torch.randn(tokens, E, generator=g)
    logits[:, 3] -= 30   # expert 3 never chosen
    logits[:, 5] += 2    # expert 5 chosen by most tokens
    ids, w = softmax_topk(logits.to(dtype), 2, True) if router == "qwen" else mixtral_topk(logits, 2)
    ref = fused_moe_reference(x, gate_up, down, ids, w, linear=cpu_ops.linear)
    assert torch.equal(cpu_moe.fused_moe(x, gate_up, down, ids, w), ref)
    if tokens <= cpu_moe.C_MAX_ROWS:   # the grouped loop runs BLAS past that
        assert torch.equal(cpu_moe.grouped_moe(x, gate_up, down, ids, w), ref)
