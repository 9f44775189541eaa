"""Random paged-cache batches for the kernel tests: ragged lengths, shuffled block ids, and
sequences that share their first blocks (a prefix-cache hit)."""
from __future__ import annotations

import torch

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def paged_batch(ctx_lens, block_size, num_kv_heads, head_dim, dtype, seed=0, shared_blocks=2, spare=3):
    """Caches filled with noise and one block table per sequence. Sequences 0 and 1 (when long
    enough) share their first `shared_blocks` blocks; every table is padded with junk ids past
    its length, so a kernel reading beyond the context picks up garbage, not zeros."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in ctx_lens]
    width = max(need) + 2
    num_blocks = sum(need) + spare + width
    perm = torch.randperm(num_blocks, generator=g).tolist()
    shared, pool = perm[:shared_blocks], perm[shared_blocks:]
    tables = torch.empty(len(ctx_lens), width, dtype=torch.int32)
    for i, n in enumerate(need):
        prefix = shared if i < 2 and n >= shared_blocks else []
        fresh, pool = pool[:n - len(prefix)], pool[n - len(prefix):]
        junk = torch.randint(0, num_blocks, (width - n,), generator=g).tolist()
        tables[i] = torch.tensor(prefix + fresh + junk, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    return k_cache, v_cache, tables, g


def spans(query_lens):
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32), torch.tensor(query_lens, dtype=torch.int32)
