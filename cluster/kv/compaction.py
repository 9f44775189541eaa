"""KV compaction of long prompts (issue 64, docs/kv_compress.md): after a prompt's prefill, each
layer and KV head keeps `KVCompaction.kept(prompt)` entries: the last `recent` prompt tokens
exact, the rest chosen among the older ones. Method "select" (SnapKV): the attention of the
prompt's last `observe` queries over the older keys, summed over those queries and the KV group's
heads, averaged over `pool` neighbouring keys, picks them; the first `sinks` tokens are always kept.
Method "fit" (attention matching, values only): select's keys, and values fitted by ridge least
squares so that the attention outputs of the prompt's last `recent` queries (every head of the
group) over the chosen keys match their outputs over the whole older part. The prototype
(bench/kv_compaction_proto.py) also fits one log-mass bias per KV head; the decode kernels read
no per-key bias, so that part is not served.

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.kv.kv_quant import cache_kind, dequantize_rows, quantize_rows
from cluster.types import KVCompaction


@dataclass(frozen=True)
class QueryCapture:
    """Where one prefill chunk's observed queries go: each layer appends its queries of the
    chunk's rows lo..hi-1 to `rows`, the sequence's own list (filled during the pass)."""
    rows: list
    lo: int
    hi: int

    def keep(self, q: torch.Tensor) -> None:
        self.rows.append(q[self.lo:self.hi].float().clone())


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


def rows_at(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One layer's keys (or values) at `slots` ([n] flat slots) as [n, Hkv, D] floats (dequantized if need be)."""
    rows = cache.reshape(-1, *cache.shape[-2:]).index_select(0, slots)
    return dequantize_rows(rows, torch.float32) if cache_kind(cache).quantized else rows.float()


def fit_values(q_fit: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor, chosen: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Attention matching's values for the chosen keys: ridge least squares (1e-2 of the mean
    diagonal, towards the chosen tokens' own values) so that softmax(q k_chosen) v matches
    softmax(q k_old) v_old for the sample queries. q_fit [n, Hq, D]; k_old, v_old [old, Hkv, D];
    chosen [Hkv, m] -> [Hkv, m, D]."""
    hkv, dim = k_old.shape[1], k_old.shape[2]
    qs = q_fit.float().permute(1, 0, 2).reshape(hkv, -1, dim)                  # [Hkv, g * n, D]
    k_heads, v_heads = k_old.transpose(0, 1), v_old.transpose(0, 1)            # [Hkv, old, D]
    index = chosen[..., None].expand(-1, -1, dim)
    k_sel, v_sel = k_heads.gather(1, index), v_heads.gather(1, index)
    target = (qs @ k_heads.transpose(1, 2) * scale).softmax(-1) @ v_heads
    a = (qs @ k_sel.transpose(1, 2) * scale).softmax(-1)                      # [Hkv, g * n, m]
    ata = a.transpose(1, 2) @ a
    lam = 1e-2 * ata.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None]
    eye = torch.eye(ata.shape[-1], device=ata.device)[None]
    # Symmetric positive definite: Cholesky (LU's pivoting, torch.linalg.solve, fails inside an
    # engine's process here: oneMKL reports a bad parameter to ?LASWP once the engine is built).
    return torch.cholesky_solve(a.transpose(1, 2) @ target + lam * v_sel, torch.linalg.cholesky(ata + lam * eye))


def _fitted_rows(v_cache: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Fitted values [Hkv, m, D] as the cache's rows [m, Hkv, D'] (quantized, if it is)."""
    rows = values.transpose(0, 1)
    kind = cache_kind(v_cache)
    return quantize_rows(rows.contiguous(), kind) if kind.quantized else rows.to(v_cache.dtype)


def gather_layer(cache: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """One layer's K (or V) cache [blocks, bs, Hkv, D']: the row of KV head h at flat slot
    src[h, i], for every head at once (one gather; a copy) -> [n, Hkv, D']."""
    flat = cache.view(-1, *cache.shape[-2:])
    heads = torch.arange(src.shape[0], device=src.device)[:, None]
    return flat[src, heads].transpose(0, 1)


def compact(arena: torch.Tensor, spec: KVCompaction, queries: list[torch.Tensor], slots: torch.Tensor,
            num_prompt: int, num_computed: int, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A sequence's compacted KV, per layer of `arena` ([layers, 2, blocks, bs, Hkv, D']): (K rows,
    V rows), each [kept + computed past the prompt, Hkv, D'], copies (the caller may free the source
    blocks before it `write`s them). `slots`: the flat slots of its cache indices 0..num_computed-1
    (its prompt, and whatever it computed past it); `queries[l]`: layer l's last `spec.observed`
    prompt queries. Per layer and KV head: the chosen older entries, then every token from the
    recent part on."""
    old, m = split(spec, num_prompt)
    tail = slots[old:num_computed]
    hkv = arena.shape[-2]
    out = []
    for layer, q_seen in enumerate(queries):
        k_cache, v_cache = arena[layer, 0], arena[layer, 1]
        k_old = rows_at(k_cache, slots[:old]) if m else None
        chosen = select(spec, q_seen[-spec.observe:], k_old, scale, m) if m else \
            torch.empty((hkv, 0), dtype=torch.long, device=slots.device)
        src = torch.cat([slots[:old][chosen], tail.expand(hkv, -1)], dim=1)    # [Hkv, kept + computed past]
        k_rows, v_rows = gather_layer(k_cache, src), gather_layer(v_cache, src)
        if spec.method == "fit" and 0 < m < old:
            v_fit = fit_values(q_seen[-(num_prompt - old):], k_old, rows_at(v_cache, slots[:old]), chosen, scale)
            v_rows[:m] = _fitted_rows(v_cache, v_fit)
        out.append((k_rows, v_rows))
    return out


def write(arena: torch.Tensor, rows: list[tuple[torch.Tensor, torch.Tensor]], dst: torch.Tensor) -> None:
    """`compact`'s rows into the flat slots `dst` of every layer."""
    for layer, (k_rows, v_rows) in enumerate(rows):
        for cache, r in ((arena[layer, 0], k_rows), (arena[layer, 1], v_rows)):
            cache.view(-1, *cache.shape[-2:])[dst] = r
