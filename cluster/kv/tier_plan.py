"""The capacity plan of the KV tiers: how many blocks each holds, and whether the machine has room.

Checked at start-up, after the engine's own memory plan: the host tier must fit in the memory the
plan leaves free (on CPU the pool and activations come out of the same memory), the disk tier in
what its directory's file system has free plus what its files already take. A configuration that
does not fit is refused with the flag to lower, never discovered later as an OOM or a full disk.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.config import KV_DISK_DEFAULT_BYTES, CacheConfig, format_size
from cluster.kv.paged_cache import MemoryPlan, available_memory
from cluster.kv.shared_host import segment_path


@dataclass(frozen=True)
class TierPlan:
    block_bytes: int          # one block of the arena, every layer's K and V
    host_blocks: int
    disk_blocks: int
    disk_dir: str | None
    host_free: int            # host memory free beside the engine's plan when planned
    disk_free: int
    shared: str | None = None   # the node-shared host segment's name

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0 or self.disk_dir is not None

    def describe(self) -> str:
        host = (f"host {format_size(self.host_blocks * self.block_bytes)} ({self.host_blocks} blocks"
                + (f", shared by this node's workers as {self.shared}" if self.shared else "")
                + f", {format_size(self.host_free)} free beside the engine)" if self.host_blocks else "host off")
        disk = (f"disk {format_size(self.disk_blocks * self.block_bytes)} ({self.disk_blocks} blocks) in "
                f"{self.disk_dir}, {format_size(self.disk_free)} free there" if self.disk_dir else "disk off")
        return f"KV tiers: {host}; {disk}"


def plan_tiers(cache: CacheConfig, plan: MemoryPlan, block_bytes: int, device: torch.device) -> TierPlan:
    host_bytes = cache.kv_host_bytes or 0
    host_free = available_memory(torch.device("cpu"))
    if device.type == "cpu":     # the pool and activations are not allocated yet: they come out of it too
        host_free -= plan.kv_bytes + plan.activation_bytes + plan.headroom_bytes
    if host_bytes and host_bytes < block_bytes:
        raise ValueError(f"--kv-host-bytes {format_size(host_bytes)} is smaller than one KV block "
                         f"({format_size(block_bytes)}); raise it or leave it out")
    shared = cache.kv_host_shared is not None and segment_path(cache.kv_host_shared).exists()
    if host_bytes > host_free and not shared:      # a node's shared segment made by another worker is counted
        raise ValueError(f"--kv-host-bytes {format_size(host_bytes)} does not fit: the host has "
                         f"{format_size(max(0, host_free))} free beside the engine's plan; lower it")
    disk_blocks, disk_free = 0, 0
    if cache.kv_disk_dir is not None:
        disk_bytes = KV_DISK_DEFAULT_BYTES if cache.kv_disk_bytes is None else cache.kv_disk_bytes
        disk_free = _disk_room(Path(cache.kv_disk_dir))
        if disk_bytes < block_bytes:
            raise ValueError(f"--kv-disk-bytes {format_size(disk_bytes)} is smaller than one KV block "
                             f"({format_size(block_bytes)}); raise it")
        if disk_bytes > disk_free:
            raise ValueError(f"--kv-disk-bytes {format_size(disk_bytes)} does not fit in {cache.kv_disk_dir}: "
                             f"{format_size(disk_free)} free there (its block files included); lower it")
        disk_blocks = disk_bytes // block_bytes
    return TierPlan(block_bytes, host_bytes // block_bytes, disk_blocks, cache.kv_disk_dir, host_free, disk_free,
                    cache.kv_host_shared)


def _disk_room(path: Path) -> int:
    """Free bytes on `path`'s file system plus what block files under it already take (the tier may reuse them)."""
    path.mkdir(parents=True, exist_ok=True)
    taken = sum(f.stat().st_size for f in path.rglob("*.kv") if f.is_file())
    return shutil.disk_usage(path).free + taken
