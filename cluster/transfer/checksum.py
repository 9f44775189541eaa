"""Per-block checksums of KV bytes, computed where the bytes are, without copying the payload.

Host memory: xxh3-64 over the block's (layer, k/v) segments in canonical order, read in place.
Device memory: a position-weighted sum computed with torch ops on the device (one small gather
per chunk of blocks, one host sync per call), then xxh3 over each block's segment sums. Every
16-bit word w_i of a segment adds w_i * c_i with c_i in [1, 2^31): the sum is exact in int64
(no wrap-around for segments of up to 2^16 words), so it does not depend on the reduction order,
it changes with any single flipped bit, and a word moved to another place changes the sum too.
Both ends of a handoff run the same device type (one EngineConfig for the whole cluster), hence
the same kind of checksum. These catch corruption, not an attacker ([security]'s HMAC does).
"""
from __future__ import annotations

import functools
import struct

import torch
import xxhash

from cluster.transfer.base import ArenaGeometry

_DEVICE_CHUNK_BLOCKS = 32   # blocks gathered at once: bounds the temporary to 32 x layers x 2 segments


def block_checksums(arena: torch.Tensor, blocks, layers=None) -> list[int]:
    """One 64-bit digest per block over its (layer, k/v) segments in canonical order."""
    geo = ArenaGeometry.of(arena)
    layers = list(range(geo.num_layers) if layers is None else layers)
    if arena.device.type == "cpu":
        return _host_checksums(arena, geo, list(blocks), layers)
    return _device_checksums(arena, geo, list(blocks), layers)


def _host_checksums(arena, geo: ArenaGeometry, blocks, layers) -> list[int]:
    flat = memoryview(arena.view(torch.uint8).numpy()).cast("B")
    seg = geo.segment_bytes
    out = []
    for b in blocks:
        h = xxhash.xxh3_64()
        for l in layers:
            for kv in (0, 1):
                start = geo.segment_index(l, kv, b) * seg
                h.update(flat[start:start + seg])
        out.append(h.intdigest())
    return out


@functools.lru_cache(maxsize=8)
def _weights(words: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(words, dtype=torch.int64)
    return ((i * 2654435761) % 2147483647 + 1).to(device)


def position_weighted_sums(segments: torch.Tensor) -> torch.Tensor:
    """[n, words] int16 -> [n] int64: sum_i (word_i as unsigned) * c_i, exact."""
    words = segments.shape[-1]
    if words > 1 << 16:
        raise ValueError(f"a KV segment of {words} 16-bit words is too long for the device checksum")
    return ((segments.to(torch.int64) & 0xFFFF) * _weights(words, segments.device)).sum(-1)


def _device_checksums(arena, geo: ArenaGeometry, blocks, layers) -> list[int]:
    words = arena.view(torch.int16).view(geo.num_layers * 2 * geo.num_blocks, -1)
    per_block = 2 * len(layers)
    sums: list[int] = []
    for c in range(0, len(blocks), _DEVICE_CHUNK_BLOCKS):
        index = torch.tensor(geo.segment_indices(blocks[c:c + _DEVICE_CHUNK_BLOCKS], layers), device=arena.device)
        sums += position_weighted_sums(words.index_select(0, index)).tolist()
    return [xxhash.xxh3_64_intdigest(struct.pack(f"<{per_block}q", *sums[i * per_block:(i + 1) * per_block]))
            for i in range(len(blocks))]
