"""The absorbed-MLA decode (kernels/mla_decode.py's signature): the C op and the Triton kernel
(interpreted) against the torch reference, over latent rows split across the cache's two planes
(an odd latent width padded), tables in random block order, lengths mid-block and of one token."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, mla_decode, mla_triton

CASES = [  # rows, heads, compressed dim, rope dim, block size, lengths
    (3, 4, 32, 8, 4, [5, 17, 1]),
    (2, 20, 33, 8, 16, [40, 3]),     # odd latent width; heads beyond one 16-head tile
]


def _inputs(rows, heads, c_dim, p_dim, block_size, lens, dtype=torch.float32):
    g = torch.Generator().manual_seed(rows * 100 + heads)
    blocks = 32
    kv = torch.randn(2, blocks, block_size, 1, -(-(c_dim + p_dim) // 2), generator=g).to(dtype)
    q_lat = torch.randn(rows, heads, c_dim, generator=g).to(dtype)
    q_pe = torch.randn(rows, heads, p_dim, generator=g).to(dtype)
    width = -(-max(lens) // block_size)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(rows)])
    return q_lat, q_pe, kv, tables, torch.tensor(lens)


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_the_reference(case):
    args = _inputs(*case)
    ref = mla_decode.mla_decode_reference(*args, 0.1)
    torch.testing.assert_close(mla_triton.mla_decode_triton(*args, 0.1), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler: fused CPU ops not built")
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES)
def test_c_op_matches_the_reference(case, dtype, atol):
    q_lat, q_pe, kv, tables, lens = _inputs(*case, dtype=dtype)
    ref = mla_decode.mla_decode_reference(q_lat.float(), q_pe.float(), kv.float(), tables, lens, 0.1)
    got = cpu_ops.mla_decode(q_lat, q_pe, kv, tables, lens, 0.1)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=1e-2)
