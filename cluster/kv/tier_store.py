"""The stores below the KV pool: a host tier of fixed slots and a disk tier of one file per block.

Both are indexes from a block's key (the pool's chained, tenant-salted hash) to where its bytes
lie, with a checksum of those bytes taken when they left the pool, in LRU order with a size limit.
Neither knows about requests or threads: `tiers.py` drives them, holding its lock around every
index change and doing the byte copies outside it.

The disk tier's file is the block's bytes after a fixed header (magic, checksum, payload length),
written to a temporary name and renamed, so a worker killed mid-write leaves no half block under a
real name. Files live in a directory named by the KV layout's hash: a worker restarted with the
same model and layout finds them and rebuilds its index, oldest first; another layout never reads
them.
"""
from __future__ import annotations

import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.kv.disk_io import FileIO, PlainFileIO
from cluster.kv.hashing import BlockHash
from cluster.kv.kv_events import KVTier

_MAGIC = b"SSKVBLK1"
_HEADER = struct.Struct("<8sQQ")     # magic, checksum, payload bytes
_SUFFIX = ".kv"


@dataclass(frozen=True)
class TierEntry:
    where: int          # the host tier's slot; the disk tier's payload bytes
    checksum: int
    gen: int = 0        # the slot's generation when read (a shared host tier reuses slots under readers)


class HostTier:
    """`capacity` slots of one block each, in host memory (pinned when the pool is on a GPU)."""

    def __init__(self, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self.capacity = capacity
        self.slots = torch.empty((capacity, *block_shape), dtype=dtype, pin_memory=pin)
        self.index: OrderedDict[BlockHash, TierEntry] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self.events = None      # a KVEventLog: what this tier gained and lost, for the router

    def _note(self, key: BlockHash, stored: bool) -> None:
        if self.events is not None:
            (self.events.stored if stored else self.events.removed)(KVTier.HOST, key)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def get(self, key: BlockHash) -> TierEntry | None:
        entry = self.index.get(key)
        if entry is not None:
            self.index.move_to_end(key)
        return entry

    def still(self, entry: TierEntry) -> bool:
        """The slot of `entry` kept its block while it was copied out: always, in a private tier
        (only its own tier thread writes slots)."""
        return True

    def take_slot(self) -> int | None:
        """A slot to write into, the least recently used entry's if none is free (it leaves the index)."""
        if self._free:
            return self._free.pop()
        if not self.index:
            return None
        key, entry = self.index.popitem(last=False)
        self._note(key, False)
        return entry.where

    def commit(self, key: BlockHash, slot: int, checksum: int) -> None:
        self.index[key] = TierEntry(slot, checksum)
        self._note(key, True)

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def drop(self, key: BlockHash) -> None:
        entry = self.index.pop(key, None)
        if entry is not None:
            self._free.append(entry.where)
            self._note(key, False)


class DiskTier:
    """Files under `root/<layout hash>/`, at most `limit` payload bytes in all."""

    def __init__(self, root: str | os.PathLike, layout_tag: str, limit: int, io: FileIO | None = None):
        """`io`: how payloads reach the files (cluster/kv/disk_io.py: NIXL's POSIX backend or plain)."""
        self.dir = Path(root) / layout_tag
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limit = limit
        self.io = io or PlainFileIO()
        self.index: OrderedDict[BlockHash, TierEntry] = OrderedDict()
        self.bytes = 0
        self.events = None      # a KVEventLog (set after the scan: `KVTiers.attach_events` reports what it found)
        self.recovered = self._scan()

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def _path(self, key: BlockHash) -> Path:
        return self.dir / (key.hex() + _SUFFIX)

    def _scan(self) -> int:
        """Rebuild the index from the files (oldest first); drop half-written and foreign files."""
        found = []
        for path in self.dir.iterdir():
            if path.suffix != _SUFFIX:
                path.unlink(missing_ok=True)    # a temporary file a killed writer left
                continue
            header = _read_header(path)
            try:
                key = bytes.fromhex(path.stem)
            except ValueError:
                header = None
            if header is None:
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime_ns, key, TierEntry(header[1], header[0])))
        for _, key, entry in sorted(found, key=lambda f: f[0]):
            self.index[key] = entry
            self.bytes += entry.where
        self._trim(0)
        return len(self.index)

    def get(self, key: BlockHash) -> TierEntry | None:
        entry = self.index.get(key)
        if entry is not None:
            self.index.move_to_end(key)
        return entry

    def write(self, key: BlockHash, payload: memoryview, checksum: int) -> bool:
        """Store a block's bytes; False when the tier cannot hold one block."""
        size = payload.nbytes
        if size > self.limit:
            return False
        self._trim(size)
        tmp = self.dir / f".{key.hex()}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, checksum, size))
            self.io.write(f, _HEADER.size, payload)
        os.replace(tmp, self._path(key))
        self.index[key] = TierEntry(size, checksum)
        self.bytes += size
        if self.events is not None:
            self.events.stored(KVTier.DISK, key)
        return True

    def read_into(self, key: BlockHash, out: memoryview) -> TierEntry | None:
        """The block's bytes into `out`; None (and the file removed) when missing or malformed."""
        entry = self.index.get(key)
        if entry is None:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                header = _parse_header(f.read(_HEADER.size))
                if header is None or header[1] != out.nbytes or self.io.readinto(f, _HEADER.size, out) != out.nbytes:
                    raise OSError("malformed block file")
        except OSError:
            self.drop(key)
            return None
        return TierEntry(header[1], header[0])

    def drop(self, key: BlockHash) -> None:
        entry = self.index.pop(key, None)
        if entry is not None:
            self.bytes -= entry.where
            if self.events is not None:
                self.events.removed(KVTier.DISK, key)
        self._path(key).unlink(missing_ok=True)

    def _trim(self, incoming: int) -> None:
        while self.index and self.bytes + incoming > self.limit:
            key = next(iter(self.index))
            self.drop(key)


def _parse_header(raw: bytes) -> tuple[int, int] | None:
    """(checksum, payload bytes) of a block file's header; None when it is not one."""
    if len(raw) != _HEADER.size:
        return None
    magic, checksum, size = _HEADER.unpack(raw)
    return (checksum, size) if magic == _MAGIC else None


def _read_header(path: Path) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as f:
            header = _parse_header(f.read(_HEADER.size))
        if header is None or path.stat().st_size != _HEADER.size + header[1]:
            return None
        return header
    except OSError:
        return None
