"""How a tensor-parallel worker's KV crosses a P/D handoff: through rank 0's export arena, which
holds every KV head of a block in the single-rank layout. The transport registers that arena with
the full layout, so a peer of any TP size sees what a TP 1 worker shows (the layout hash of the
model, not of a rank), and checksums, leases and byte counters work as they do for TP 1.

- gather (a prefill worker, before it publishes a request's blocks): every rank sends rank 0 its
  heads of those blocks (one all-gather, padded to the widest rank), rank 0 writes each rank's
  heads at their place in the export arena.
- scatter (a decode worker, after a pull into the export arena, before the request joins): rank 0
  broadcasts the blocks with every head, each rank copies its own heads into its arena.

Block ids are the same on every rank (one scheduler), and in the export arena.
"""
from __future__ import annotations

import dataclasses

import torch

from cluster.kv.paged_cache import PagedKVCache
from cluster.parallel.group import RankGroup
from cluster.parallel.sharding import RankShard
from cluster.parallel.step_message import StepSender, control_message
from cluster.types import KVLayout


def full_layout(layout: KVLayout) -> KVLayout:
    """A rank's layout widened to every KV head, as a single-rank worker's."""
    return dataclasses.replace(layout, num_kv_heads=layout.total_kv_heads or layout.num_kv_heads, tp_size=1,
                               tp_rank=0, kv_head_start=0, total_kv_heads=0)


def _index(blocks: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(blocks, dtype=torch.long, device=device)


def gather_blocks(group: RankGroup, arena: torch.Tensor, shards: list[RankShard], blocks: tuple[int, ...],
                  export: torch.Tensor | None) -> None:
    """Every rank's heads of `blocks` into rank 0's `export` arena (None on the other ranks)."""
    idx = _index(blocks, arena.device)
    own = arena.index_select(2, idx)                       # [L, 2, n, bs, h_rank, D]
    widest = max(s.kv_heads for s in shards)
    if own.shape[-2] < widest:
        pad = own.new_zeros(*own.shape[:-2], widest - own.shape[-2], own.shape[-1])
        own = torch.cat([own, pad], dim=-2)
    parts = [torch.empty_like(own) for _ in shards]
    torch.distributed.all_gather(parts, own.contiguous())
    if export is None:
        return
    for shard, part in zip(shards, parts):
        heads = slice(shard.kv_start, shard.kv_start + shard.kv_heads)
        view = export[:, :, :, :, heads]
        view.index_copy_(2, idx, part[..., : shard.kv_heads, :])


def scatter_blocks(group: RankGroup, arena: torch.Tensor, shard: RankShard, blocks: tuple[int, ...],
                   export: torch.Tensor | None, full_shape: tuple[int, ...]) -> None:
    """Rank 0's `export` blocks (every head) to every rank, each keeping its own heads."""
    idx = _index(blocks, arena.device)
    shape = (*full_shape[:2], len(blocks), *full_shape[3:])
    full = export.index_select(2, idx).contiguous() if export is not None else \
        torch.empty(shape, dtype=arena.dtype, device=arena.device)
    group.broadcast(full)
    arena.index_copy_(2, idx, full[..., shard.kv_start:shard.kv_start + shard.kv_heads, :])


class KVExport:
    """Rank 0's export arena and the two moves through it."""

    def __init__(self, group: RankGroup, sender: StepSender, rank_cache: PagedKVCache, shards: list[RankShard]):
        self.group, self.sender, self.shards = group, sender, shards
        self.rank_arena = rank_cache.arena
        self.layout = full_layout(rank_cache.layout)
        self.cache = PagedKVCache(self.layout, rank_cache.num_blocks, rank_cache.arena.device)
        self.arena = self.cache.arena

    def gather(self, blocks) -> None:
        """Every rank's heads of `blocks` into the export arena (before they are published)."""
        blocks = tuple(blocks)
        self.sender.send(control_message(self.group.device, "gather", blocks))
        gather_blocks(self.group, self.rank_arena, self.shards, blocks, self.arena)

    def scatter(self, blocks) -> None:
        """The export arena's `blocks` (just pulled) to every rank's arena (before they are read)."""
        blocks = tuple(blocks)
        self.sender.send(control_message(self.group.device, "scatter", blocks))
        scatter_blocks(self.group, self.rank_arena, self.shards[0], blocks, self.arena, tuple(self.arena.shape))
