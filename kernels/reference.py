"""Torch references of every kernel, with the same signatures: plain loops over sequences, fp32
softmax, written to be obviously right rather than fast. Tests and bench/kernel_speed.py compare the
Triton kernels against these; tuning arguments (partition, tiles, workspace) are accepted and ignored.
"""
from __future__ import annotations

import torch


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _gather(cache, table, length):
    """Positions 0 .. length-1 of one sequence: [length, Hkv, D]."""
    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    return cache[table[pos // bs].long(), pos % bs]


def _attend(q, keys, vals, qpos, window, scale):
    """q: [n, Hq, D] at positions qpos [n]; keys/vals: [L, Hkv, D] at positions 0..L-1."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)   # [L, Hq, D]
    v = vals.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    kpos = torch.arange(keys.shape[0], device=q.device)
    allowed = kpos[None, :] <= qpos[:, None]
    if window is not None:
        allowed &= kpos[None, :] > qpos[:, None] - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _spans(q, k_cache, v_cache, block_tables, starts, lens, ctx_lens, scale, window, out):
    out = torch.empty_like(q) if out is None else out
    for i, (s, n, ctx) in enumerate(zip(starts, lens, ctx_lens)):
        keys = _gather(k_cache, block_tables[i], ctx)
        vals = _gather(v_cache, block_tables[i], ctx)
        qpos = torch.arange(ctx - n, ctx, device=q.device)
        out[s:s + n] = _attend(q[s:s + n], keys, vals, qpos, window, scale)
    return out


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window=None,
                               max_context=None, partition_size=None, out=None, workspace=None):
    lens = context_lens.tolist()
    return _spans(q, k_cache, v_cache, block_tables, range(len(lens)), [1] * len(lens), lens, scale, window, out)


def paged_verify_attention_ref(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens,
                               max_query_len, scale, window=None, max_context=None, partition_size=None, out=None,
                               workspace=None):
    return _spans(q, k_cache, v_cache, block_tables, query_starts.tolist(), query_lens.tolist(),
                  context_lens.tolist(), scale, window, out)


def prefill_attention_ref(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens,
                          max_query_len, scale, window=None, tiles=None, out=None):
    return _spans(q, k_cache, v_cache, block_tables, query_starts.tolist(), query_lens.tolist(),
                  context_lens.tolist(), scale, window, out)
