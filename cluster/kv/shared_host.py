"""A host tier shared by the workers of one node: one segment in shared memory, one index in it.

The segment is a file under /dev/shm that every worker started with the same `--kv-host-shared`
name maps: a header, a table of entries (one per slot: the key, its checksum, an LRU stamp, a
generation and a state), an open-addressing hash table from key to slot, then the slots. A prefix
any worker of the node stored is found by every other.

Concurrency: every index change and lookup holds an exclusive `flock` on the segment (released by
the kernel if its holder dies) for microseconds; byte copies run outside it. A writer takes a slot
(state WRITING, its generation bumped), copies, then commits the key. A reader takes the slot and
generation under the lock, copies out, then asks `still` whether the slot kept that generation:
if another worker reused the slot meanwhile, the read was torn and counts as a miss (the block is
recomputed or read from disk), never as corruption. A slot left WRITING by a worker that died is
reclaimed when its pid is gone.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np
import torch

from cluster.kv.hashing import BlockHash
from cluster.kv.kv_events import KVTier
from cluster.kv.tier_store import TierEntry

_MAGIC = b"SSKVSHM1"
_HEADER = struct.Struct("<8sQQQ32s")     # magic, capacity, slot bytes, clock, layout tag
_HEADER_BYTES = 4096
_FREE, _WRITING, _VALID = 0, 1, 2
_EMPTY = -1
_ENTRY = np.dtype([("key", "V16"), ("checksum", "<u8"), ("stamp", "<u8"), ("gen", "<u8"), ("pid", "<i8"),
                   ("state", "<u8")])


def segment_path(name: str) -> Path:
    return Path("/dev/shm") / f"splitserve-kv-{name}"


class SharedHostTier:
    """HostTier's interface (tiers.py drives both) over a node-wide segment."""

    def __init__(self, name: str, capacity: int, block_shape: tuple[int, ...], dtype: torch.dtype, layout_tag: str):
        self.capacity = capacity
        self.path = segment_path(name)
        slot_bytes = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        self._table_len = 2 * capacity
        entries_at = _HEADER_BYTES
        table_at = entries_at + _ENTRY.itemsize * capacity
        slots_at = -(-(table_at + 8 * self._table_len) // 4096) * 4096
        size = slots_at + slot_bytes * capacity
        self._thread_lock = threading.Lock()
        self.events = None      # a KVEventLog: the changes this worker makes, for the router
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            self._attach(size, capacity, slot_bytes, layout_tag)
        self._map = mmap.mmap(self._fd, size)
        self.entries = np.frombuffer(self._map, dtype=_ENTRY, count=capacity, offset=entries_at)
        self.table = np.frombuffer(self._map, dtype="<i8", count=self._table_len, offset=table_at)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=slot_bytes * capacity, offset=slots_at)
        self.slots = raw.view(dtype).view(capacity, *block_shape)
        self._header = np.frombuffer(self._map, dtype="<u8", count=4, offset=0)   # [magic, capacity, slot, clock]

    def _attach(self, size: int, capacity: int, slot_bytes: int, layout_tag: str) -> None:
        """Create the segment (the node's first worker) or check it is this one's shape."""
        tag = layout_tag.encode()[:32].ljust(32, b"\0")
        if os.fstat(self._fd).st_size == 0:
            os.ftruncate(self._fd, size)
            with mmap.mmap(self._fd, _HEADER_BYTES) as m:
                m[:_HEADER.size] = _HEADER.pack(_MAGIC, capacity, slot_bytes, 0, tag)
            with mmap.mmap(self._fd, size) as m:        # every table cell empty
                np.frombuffer(m, dtype="<i8", count=self._table_len,
                              offset=_HEADER_BYTES + _ENTRY.itemsize * capacity)[:] = _EMPTY
            return
        with mmap.mmap(self._fd, _HEADER_BYTES) as m:
            magic, cap, slot, _, found = _HEADER.unpack(m[:_HEADER.size])
        if (magic, cap, slot, found) != (_MAGIC, capacity, slot_bytes, tag) or os.fstat(self._fd).st_size != size:
            raise ValueError(f"the shared KV host tier {self.path} was made for another model or size "
                             f"({cap} slots of {slot} bytes); every worker of a node must share one "
                             "--kv-host-bytes and model, or use another --kv-host-shared name")

    def _locked(self):
        return _FileLock(self._fd, self._thread_lock)

    # --- the index (HostTier's interface) --------------------------------------------------------
    def __contains__(self, key: BlockHash) -> bool:
        with self._locked():
            return self._find(key)[1] >= 0

    def __len__(self) -> int:
        return int(np.count_nonzero(self.entries["state"] == _VALID))

    def get(self, key: BlockHash) -> TierEntry | None:
        with self._locked():
            slot = self._find(key)[1]
            if slot < 0:
                return None
            e = self.entries[slot]
            self.entries["stamp"][slot] = self._tick()
            return TierEntry(slot, int(e["checksum"]), int(e["gen"]))

    def still(self, entry: TierEntry) -> bool:
        """The slot read for `entry` kept its block while it was copied (no other writer reused it)."""
        with self._locked():
            return int(self.entries["gen"][entry.where]) == entry.gen and \
                int(self.entries["state"][entry.where]) == _VALID

    def take_slot(self) -> int | None:
        with self._locked():
            state = self.entries["state"]
            free = np.flatnonzero(state == _FREE)
            if not len(free):
                free = self._dead_writers()
            if len(free):
                slot = int(free[0])
            else:
                valid = np.flatnonzero(state == _VALID)
                if not len(valid):
                    return None
                slot = int(valid[np.argmin(self.entries["stamp"][valid])])
                evicted = bytes(self.entries["key"][slot])
                self._unlink(evicted)
                self._note(evicted, False)
            self.entries["state"][slot] = _WRITING
            self.entries["gen"][slot] += 1
            self.entries["pid"][slot] = os.getpid()
            return slot

    def commit(self, key: BlockHash, slot: int, checksum: int) -> None:
        with self._locked():
            if self._find(key)[1] >= 0:       # another worker stored the same block meanwhile
                self.entries["state"][slot] = _FREE
                return
            self.entries["key"][slot] = np.void(key)
            self.entries["checksum"][slot] = checksum
            self.entries["stamp"][slot] = self._tick()
            self.entries["state"][slot] = _VALID
            self._insert(key, slot)
            self._note(key, True)

    def give_back(self, slot: int) -> None:
        with self._locked():
            self.entries["state"][slot] = _FREE

    def drop(self, key: BlockHash) -> None:
        with self._locked():
            slot = self._unlink(key)
            if slot >= 0:
                self.entries["state"][slot] = _FREE
                self._note(key, False)

    def keys(self) -> list[BlockHash]:
        """Every key the segment holds, whoever stored it (the router's snapshot of this tier)."""
        with self._locked():
            return [bytes(k) for k in self.entries["key"][self.entries["state"] == _VALID]]

    def _note(self, key: BlockHash, stored: bool) -> None:
        if self.events is not None:
            (self.events.stored if stored else self.events.removed)(KVTier.HOST, key)

    def close(self) -> None:
        del self.entries, self.table, self.slots, self._header
        try:
            self._map.close()
        except BufferError:       # a view of the slots still lives somewhere: the mapping goes with it
            pass
        os.close(self._fd)

    # --- the hash table (lock held) --------------------------------------------------------------
    def _tick(self) -> int:
        self._header[3] += 1
        return int(self._header[3])

    def _home(self, key: BlockHash) -> int:
        return int.from_bytes(key[:8], "little") % self._table_len

    def _find(self, key: BlockHash) -> tuple[int, int]:
        """(table cell, slot) of `key`, or (the empty cell to insert it at, -1). Linear probing at a
        load of at most one half: chains stay short, and deletion shifts back (no tombstones)."""
        i = self._home(key)
        while True:
            slot = int(self.table[i])
            if slot == _EMPTY:
                return i, -1
            if bytes(self.entries["key"][slot]) == key:
                return i, slot
            i = (i + 1) % self._table_len

    def _insert(self, key: BlockHash, slot: int) -> None:
        cell, _ = self._find(key)
        self.table[cell] = slot

    def _unlink(self, key: BlockHash) -> int:
        """Take `key` out of the table; its slot (or -1). Later cells of its chain move back into the
        gap where their home allows, so every key stays reachable from its home."""
        i, slot = self._find(key)
        if slot < 0:
            return -1
        j = i
        while True:
            j = (j + 1) % self._table_len
            moving = int(self.table[j])
            if moving == _EMPTY:
                break
            home = self._home(bytes(self.entries["key"][moving]))
            if (i < j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue                      # its home lies between the gap and it: it stays
            self.table[i] = moving
            i = j
        self.table[i] = _EMPTY
        return slot

    def _dead_writers(self) -> np.ndarray:
        """Slots left WRITING by a process that no longer exists (killed mid-copy): free again."""
        stuck = np.flatnonzero(self.entries["state"] == _WRITING)
        dead = [int(s) for s in stuck if not _alive(int(self.entries["pid"][s]))]
        return np.array(dead, dtype=np.int64)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _FileLock:
    """An exclusive flock on the segment, and a thread lock: flock alone does not exclude two threads
    of one process that share the descriptor."""

    def __init__(self, fd: int, thread_lock: threading.Lock):
        self.fd, self.thread_lock = fd, thread_lock

    def __enter__(self):
        self.thread_lock.acquire()
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.thread_lock.release()
