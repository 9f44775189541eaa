"""A windowed sequence's decode (cluster/kv/window.py): its block table keeps the sink blocks and
the window's only, in scattered physical blocks, and its context length counts the live tokens.
The C kernel and the Triton kernel read such a table as a plain shorter sequence; both must equal
torch attention over the full logical sequence under the sink + window mask."""
from __future__ import annotations

import pytest
import torch

from cluster.kv.window import KVWindow
from kernels import cpu_ops
from kernels.decode import paged_decode_attention

BS, HQ, HKV, D = 4, 4, 2, 16
WINDOW = KVWindow(window=10, sink_tokens=3, block_size=BS)


def _case(num_tokens: int, seed: int):
    """Logical K/V of `num_tokens` positions, the windowed live table over scattered blocks, and
    the reference output of the last query under the window's mask."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_tokens, HKV, D, generator=g)
    vals = torch.randn(num_tokens, HKV, D, generator=g)
    q = torch.randn(HQ, D, generator=g)
    query = num_tokens - 1
    logical = [b for b in range(-(-num_tokens // BS))
               if b < WINDOW.sink_blocks or b >= WINDOW.first_window_block(query)]
    physical = torch.randperm(64, generator=g)[:len(logical)].tolist()
    k_cache, v_cache = torch.zeros(64, BS, HKV, D), torch.zeros(64, BS, HKV, D)
    for lb, pb in zip(logical, physical):
        n = min(BS, num_tokens - lb * BS)
        k_cache[pb, :n], v_cache[pb, :n] = keys[lb * BS:lb * BS + n], vals[lb * BS:lb * BS + n]
    live = sum(min(BS, num_tokens - lb * BS) for lb in logical)
    pos = torch.arange(num_tokens)
    allowed = WINDOW.mask(torch.tensor([[query]]), pos[None])[0]
    kk = keys[allowed].repeat_interleave(HQ // HKV, dim=1)        # [L, Hq, D]
    vv = vals[allowed].repeat_interleave(HQ // HKV, dim=1)
    att = torch.softmax(torch.einsum("hd,lhd->hl", q, kk) * D ** -0.5, dim=-1)
    want = torch.einsum("hl,lhd->hd", att, vv)
    return q, k_cache, v_cache, physical, live, want


@pytest.mark.parametrize("num_tokens", [9, 23, 40])
def test_c_and_triton_decode_read_windowed_tables(num_tokens):
    q, k_cache, v_cache, physical, live, want = _case(num_tokens, seed=num_tokens)
    tables = torch.tensor([physical], dtype=torch.long)
    lens = torch.tensor([live], dtype=torch.long)
    got = paged_decode_attention(q[None], k_cache, v_cache, tables.int(), lens.int(), D ** -0.5)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    if cpu_ops.load() is None:
        pytest.skip("the C ops are not built here")
    got_c = cpu_ops.decode_attention(q[None], k_cache, v_cache, tables, lens, None, D ** -0.5)
    torch.testing.assert_close(got_c[0], want, atol=1e-5, rtol=1e-5)
