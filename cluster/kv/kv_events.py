"""KV events: what a worker's pool and tiers gained and lost, for the router's cluster-wide index.

Every change of what a worker can serve as a prefix hit is one event: a block key stored in or
removed from a tier (the device pool, the host tier, the disk tier). The worker keeps them in a
bounded log, consecutive changes of one kind and tier batched into one event, each with a
sequence number; the router reads the log with a cursor (`KVEventLog.read`), so a reader that
missed nothing gets only what changed, and one whose cursor fell off the log (or who saw another
incarnation, `epoch`) gets a snapshot: every key the worker holds, per tier. The log mirrors what
it reported, so a snapshot is consistent with the sequence number it comes with, read under the
log's lock without touching the pool (which belongs to the engine thread).

A host tier shared by the workers of a node (`--kv-host-shared`) has one `host_domain` for all of
them: each worker logs the changes it made, and its snapshot of that tier is the segment's own
index, which every worker of the node changes.
"""
from __future__ import annotations

import enum
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cluster.kv.hashing import BlockHash

KV_EVENTS_VERSION = 1
MAX_KEYS_PER_EVENT = 512


class KVTier(str, enum.Enum):
    POOL = "pool"
    HOST = "host"
    DISK = "disk"


class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: KVEventKind
    tier: KVTier
    keys: tuple[BlockHash, ...]


@dataclass(frozen=True)
class KVEventBatch:
    """One read of a worker's log: the events after the reader's cursor, or a snapshot."""
    worker: str
    epoch: str                     # the log's incarnation: another one means the reader starts over
    host_domain: str               # who shares the host tier: the worker's name when private
    cursor: int                    # read from here next time
    events: tuple[KVEvent, ...] = ()
    snapshot: tuple[tuple[KVTier, tuple[BlockHash, ...]], ...] | None = None   # every key held, per tier
    version: int = KV_EVENTS_VERSION


class KVEventLog:
    def __init__(self, worker: str, host_domain: str = "", capacity: int = 4096):
        self.worker = worker
        self.host_domain = host_domain or worker
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._pending: tuple[KVEventKind, KVTier, list[BlockHash]] | None = None
        self._next_seq = 0
        self._held: dict[KVTier, set[BlockHash]] = {t: set() for t in KVTier}
        # A tier whose snapshot is read from its store (the node-shared host tier), not mirrored.
        self.snapshot_sources: dict[KVTier, Callable[[], Iterable[BlockHash]]] = {}

    def stored(self, tier: KVTier, key: BlockHash) -> None:
        self._record(KVEventKind.STORED, tier, key)

    def removed(self, tier: KVTier, key: BlockHash) -> None:
        self._record(KVEventKind.REMOVED, tier, key)

    def _record(self, kind: KVEventKind, tier: KVTier, key: BlockHash) -> None:
        with self._lock:
            held = self._held[tier]
            # No change, unless the tier is shared: another worker of the node may have stored it.
            if tier not in self.snapshot_sources and (key in held) == (kind is KVEventKind.STORED):
                return
            if kind is KVEventKind.STORED:
                held.add(key)
            else:
                held.discard(key)
            p = self._pending
            if p is None or p[0] is not kind or p[1] is not tier or len(p[2]) >= MAX_KEYS_PER_EVENT:
                self._seal()
                self._pending = (kind, tier, [key])
            else:
                p[2].append(key)

    def _seal(self) -> None:
        if self._pending is not None:
            kind, tier, keys = self._pending
            self._events.append(KVEvent(self._next_seq, kind, tier, tuple(keys)))
            self._next_seq += 1
            self._pending = None

    def read(self, epoch: str, cursor: int) -> KVEventBatch:
        """What changed since `cursor` of `epoch`; a snapshot when the reader cannot catch up."""
        sources = {t: tuple(f()) for t, f in self.snapshot_sources.items()}   # outside the lock: takes a flock
        with self._lock:
            self._seal()
            oldest = self._events[0].seq if self._events else self._next_seq
            if epoch == self.epoch and oldest <= cursor <= self._next_seq:
                events = tuple(e for e in self._events if e.seq >= cursor)
                return KVEventBatch(self.worker, self.epoch, self.host_domain, self._next_seq, events)
            snapshot = tuple((t, sources.get(t, tuple(self._held[t]))) for t in KVTier)
            return KVEventBatch(self.worker, self.epoch, self.host_domain, self._next_seq, snapshot=snapshot)
