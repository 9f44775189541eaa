"""Per-block checksums of KV bytes (xxh3-64), computed in place without copying the payload."""
from __future__ import annotations

import torch
import xxhash

from cluster.transfer.base import ArenaGeometry


def block_checksums(arena: torch.Tensor, blocks, layers=None) -> list[int]:
    """One xxh3-64 digest per block over its (layer, k/v) segments in canonical order."""
    geo = ArenaGeometry.of(arena)
    flat = memoryview(arena.view(torch.uint8).numpy()).cast("B") if arena.device.type == "cpu" else None
    if flat is None:
        raise NotImplementedError("checksums of device memory are computed after a host copy")
    seg = geo.segment_bytes
    layers = range(geo.num_layers) if layers is None else layers
    out = []
    for b in blocks:
        h = xxhash.xxh3_64()
        for l in layers:
            for kv in (0, 1):
                start = geo.segment_index(l, kv, b) * seg
                h.update(flat[start:start + seg])
        out.append(h.intdigest())
    return out
