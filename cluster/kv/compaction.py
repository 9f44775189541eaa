"""KV compaction of long prompts (issue 64, docs/kv_compress.md): after a prompt's prefill, each
layer and KV head keeps `KVCompaction.kept(prompt)` entries: the last `recent` prompt tokens
exact, the rest chosen among the older ones. Method "select" (SnapKV): the attention of the
prompt's last `observe` queries over the older keys, summed over those queries and the KV group's
heads, averaged over `pool` neighbouring keys, picks them; the first `sinks` tokens are always kept.

Layout (the decode kernels need no change): attention over cached keys does not depend on their
order once they carry their RoPE rotation, so a compacted prompt occupies new blocks in which
slot i of layer l, KV head h holds that (l, h)'s i-th kept entry (different tokens per layer and
head), then the recent tokens, then what the sequence generates: its position p sits at cache
index p - cache_offset (cache_offset = prompt - kept), as a windowed sequence's
(cluster/kv/window.py) does. One gather per layer moves the kept rows, whatever the cache's
dtype (a quantized row carries its own scale).

The selection here is independent of the serving path's bookkeeping (cluster/engine/compaction.py
captures the queries and swaps the blocks): pure tensor functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.kv.kv_quant import cache_kind, dequantize_rows
from cluster.types import KVCompaction


def split(spec: KVCompaction, num_prompt: int) -> tuple[int, int]:
    """(older prompt tokens to choose from, entries chosen among them): the last
    min(recent, kept) prompt tokens are kept exact."""
    kept = spec.kept(num_prompt)
    recent = min(spec.recent, kept)
    return num_prompt - recent, kept - recent


def select(spec: KVCompaction, q_obs: torch.Tensor, k_old: torch.Tensor, scale: float, m: int) -> torch.Tensor:
    """SnapKV: per KV head, the `m` older keys the observation queries attend most (pooled), in
    token order. q_obs [obs, Hq, D], k_old [old, Hkv, D] -> [Hkv, m] token indices."""
    old, hkv, dim = k_old.shape
    if m >= old:
        return torch.arange(old, device=k_old.device).expand(hkv, old)
    g = q_obs.shape[1] // hkv
    q = q_obs.float().permute(1, 0, 2).reshape(hkv, g * q_obs.shape[0], dim)   # query head h: KV head h // g
    logits = torch.einsum("hqd,khd->hqk", q, k_old.float()) * scale
    votes = logits.softmax(-1).sum(1)                                            # [Hkv, old]
    votes = F.avg_pool1d(votes[:, None], spec.pool, 1, spec.pool // 2)[:, 0]
    votes[:, :min(spec.sinks, old)] = float("inf")   # the attention sinks always stay
    return votes.topk(m, dim=-1).indices.sort(-1).values


def prompt_keys(k_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One layer's keys at `slots` ([n] flat slots) as [n, Hkv, D] floats (dequantized if need be)."""
    rows = k_cache.reshape(-1, *k_cache.shape[-2:]).index_select(0, slots)
    return dequantize_rows(rows, torch.float32) if cache_kind(k_cache).quantized else rows.float()


def gather_layer(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """One layer's K (or V) cache [blocks, bs, Hkv, D']: the row of KV head h at flat slot
    src[h, i] to flat slot dst[i], for every head at once (one gather, one scatter)."""
    flat = cache.view(-1, *cache.shape[-2:])
    heads = torch.arange(src.shape[0], device=src.device)[:, None]
    flat[dst] = flat[src, heads].transpose(0, 1)    # advanced indexing copies: dst may not alias src


def compact(arena: torch.Tensor, spec: KVCompaction, queries: list[torch.Tensor], slots: torch.Tensor,
            num_prompt: int, num_computed: int, dst: torch.Tensor, scale: float) -> None:
    """Write a sequence's compacted KV into the slots `dst` of every layer of `arena` ([layers, 2,
    blocks, bs, Hkv, D']). `slots`: the flat slots of its cache indices 0..num_computed-1 (its
    prompt, and whatever it computed past it); `queries[l]`: layer l's observation queries.
    Per layer and KV head: the chosen older entries, then every token from the recent part on."""
    old, m = split(spec, num_prompt)
    tail = slots[old:num_computed]
    hkv = arena.shape[-2]
    for layer, q_obs in enumerate(queries):
        k_cache, v_cache = arena[layer, 0], arena[layer, 1]
        chosen = select(spec, q_obs, prompt_keys(k_cache, slots[:old]), scale, m) if m else \
            torch.empty((hkv, 0), dtype=torch.long, device=slots.device)
        src = torch.cat([slots[:old][chosen], tail.expand(hkv, -1)], dim=1)    # [Hkv, kept + computed past]
        gather_layer(k_cache, src, dst)
        gather_layer(v_cache, src, dst)
