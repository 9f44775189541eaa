"""The CPU mixture-of-experts paths (kernels/cpu_moe.py) against the torch reference
(kernels/moe_reference.py) with the same GEMM per expert: the deterministic mode's one-call C
kernel (the C linear everywhere), the default one (BLAS for an expert of many rows) and the
grouped loop give the reference's bits in float32 and bfloat16, with Qwen's and Mixtral's weight dtypes, experts without
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
    ref = fused_moe_reference(x, gate_up, down, ids, w, linear=cpu_ops.linear, activation=cpu_ops.silu_mul)
    assert torch.equal(cpu_moe.fused_moe_invariant(x, gate_up, down, ids, w), ref)
    # The default path and the grouped loop run torch's GEMM and SiLU for an expert of more than
    # C_MAX_ROWS rows: the same bits as the reference with those same choices.
    mixed = fused_moe_reference(x, gate_up, down, ids, w, linear=cpu_moe._grouped_linear,
                                activation=cpu_moe._grouped_act)
    assert torch.equal(cpu_moe.fused_moe(x, gate_up, down, ids, w), mixed)
    assert torch.equal(cpu_moe.grouped_moe(x, gate_up, down, ids, w), mixed)
