"""Chained block hashes for prefix caching.

A full block's key is a digest of (parent block's key, the block's token ids, optional salt).
The digest is stable across processes and machines (blake2b, not Python's `hash`), so the
router can score prefix affinity with the very keys the workers' pools use.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"splitserve-v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(_ROOT)
        if salt:
            # Salt only the first block: the chain carries it to every later block.
            h.update(b"\x00salt\x00" + salt.encode())
    else:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                       start: list[BlockHash] | None = None) -> list[BlockHash]:
    """Keys of every full block of `token_ids`, extending `start` (already computed keys)."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt))
    return hashes
