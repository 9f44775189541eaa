"""store_kv scatters rows exactly like the reference, from strided (fused-projection) inputs,
and skips padding slots (-1)."""
import pytest
import torch

from kernels.reference import store_kv_ref
from kernels.store_kv import store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,heads,head_dim", [(1, 1, 16), (4, 2, 24), (16, 3, 8)])
def test_store_kv_matches_reference(dtype, block_size, heads, head_dim):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, tokens = 12, 9
    # k and v as the model hands them over: views into one fused qkv row per token.
    qkv = torch.randn(tokens, 3 * heads, head_dim, generator=g).to(dtype)
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[3] = -1
    caches = torch.randn(2, num_blocks, block_size, heads, head_dim, generator=g).to(dtype)
    got, want = caches.clone(), caches.clone()
    store_kv(k, v, got[0], got[1], slots)
    store_kv_ref(k, v, want[0], want[1], slots)
    assert torch.equal(got, want)
    assert torch.equal(got.view(2, -1, heads, head_dim)[0, slots[0]], k[0])
