"""KV tiers below an engine's block pool: blocks go down when published, come up on a prefix hit.

Write-through: every block the pool publishes (a full block with its prefix key) is copied to the
host tier, and from there to the disk tier, by one background thread, while a reference pins the
block so nothing overwrites it mid-copy. The pool then evicts as before, losing nothing a tier
holds. A request whose prompt continues past the pool's cached prefix into blocks a tier holds is
parked on arrival (prefetch): the engine allocates blocks for them, the thread copies the bytes in
and checks each block against the checksum taken when it left the pool, and once done the blocks
are published in the pool and the request is queued; the scheduler then finds them as ordinary
prefix hits. A block that fails its check is dropped from the tier and it and every later block
of that request are recomputed, never served.

Threads: the engine thread owns the pool and every request (`offload`, `prefetch`, `poll`); the
tier thread only moves bytes and edits the tiers' indexes under `_lock`. Completed jobs come back
through a queue that `poll` drains at the start of every step; `notify` wakes an idle engine loop.
Loads go before offloads: a load is on a request's time to first token, an offload on nobody's.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cluster.kv.block_pool import BlockPool
from cluster.kv.hashing import BlockHash
from cluster.kv.kv_events import KVEventLog, KVTier
from cluster.kv.shared_host import SharedHostTier
from cluster.kv.tier_store import DiskTier, HostTier
from cluster.transfer.checksum import block_checksums
from cluster.worker_messages import TierStats

log = logging.getLogger(__name__)

HOST, DISK = "host", "disk"


@dataclass
class _Load:
    seq: object                   # the engine's Sequence (not imported: the core's kv layer knows no engine)
    keys: list[BlockHash]
    blocks: list[int]             # pool blocks allocated for them, in order
    pins: list[int]               # the pool's own cached prefix, pinned while the load runs
    good: int = 0                 # leading blocks loaded and checked
    tiers: list[str] = field(default_factory=list)


class KVTiers:
    def __init__(self, pool: BlockPool, arena: torch.Tensor, host: HostTier | SharedHostTier, disk: DiskTier | None,
                 notify: Callable[[], None] | None = None):
        self.pool = pool
        self.arena = arena
        block_shape = tuple(arena[:, :, 0].shape)
        self.host = host
        self.disk = disk
        self._staging = torch.empty(block_shape, dtype=arena.dtype, pin_memory=arena.device.type == "cuda")
        self.notify = notify
        self._lock = threading.Lock()
        self._jobs = threading.Condition()
        self._loads: deque[_Load] = deque()
        self._offloads: deque[tuple[int, BlockHash]] = deque()
        self._done: deque[tuple[str, object]] = deque()
        self._parked: dict[object, _Load] = {}
        self._offloading = 0          # offload jobs not yet polled back (their blocks pinned)
        self.counts = {"offloaded": 0, HOST: 0, DISK: 0, "corrupt": 0}
        self.load_seconds = 0.0       # the tier thread's time in loads (the router's fetch-or-compute costs)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    # --- the engine thread ---------------------------------------------------------------
    def holds(self, key: BlockHash) -> bool:
        # Lock-free: only the tier thread changes the indexes, and a dict's `in` is atomic. A key
        # that leaves a tier after this answer makes a load fall short, which `_load` handles.
        return key in self.host or (self.disk is not None and key in self.disk)

    def offload(self, block: int, key: BlockHash) -> None:
        """The pool published `block` under `key`: copy it down unless a tier has it already."""
        if self.holds(key):
            return
        self.pool.touch([block])          # pinned until copied
        self._offloading += 1
        with self._jobs:
            self._offloads.append((block, key))
            self._jobs.notify()

    def would_load(self, keys: list[BlockHash], usable: int) -> bool:
        """Whether a tier holds the block after the pool's cached prefix of `keys[:usable]`."""
        cached = self.pool.match_prefix(keys[:usable])
        return len(cached) < usable and self.holds(keys[len(cached)])

    def prefetch(self, seq, keys: list[BlockHash], usable: int) -> bool:
        """Park `seq` while the blocks of its prompt that a tier holds past the pool's own cached
        prefix load; False (queue it now) when there are none or no free blocks to load into."""
        cached = self.pool.match_prefix(keys[:usable])
        lower = []
        for key in keys[len(cached):usable]:
            if not self.holds(key):
                break
            lower.append(key)
        if not lower:
            return False
        # Pin the cached prefix first: those of its blocks nobody holds are in the free queue, and
        # pinning takes them out of it, so only what is free after that is room for the load.
        self.pool.touch(cached)
        lower = lower[:max(0, self.pool.num_free - 1)]     # leave a block for the rest of the prompt
        if not lower:
            self.pool.free(reversed(cached))
            return False
        load = _Load(seq, lower, self.pool.allocate(len(lower)), list(cached))
        self._parked[seq] = load
        with self._jobs:
            self._loads.append(load)
            self._jobs.notify()
        return True

    def poll(self) -> list:
        """Finish what the tier thread completed: unpin offloaded blocks, publish loaded ones.
        Returns the parked requests now ready to queue."""
        ready = []
        while self._done:
            kind, job = self._done.popleft()
            if kind == "offload":
                self._offloading -= 1
                self.pool.free([job])
                continue
            ready += self._finish_load(job)
        return ready

    def _finish_load(self, load: _Load) -> list:
        del self._parked[load.seq]
        kept = load.blocks[:load.good]
        for block, key in zip(kept, load.keys):
            self.pool.cache_block(block, key)
        self.pool.free(reversed(load.blocks[load.good:]))
        for tier in load.tiers:
            self.counts[tier] += 1
        # The pins end here, not at admission: a queued request that held blocks would be a
        # resource the scheduler cannot see (two parked requests, each waiting behind blocks the
        # other pins, stalled a decode worker). Freed, the blocks stay cached at the LRU's tail,
        # where admission finds them as prefix hits.
        self.pool.free(reversed(load.pins + kept))
        return [] if load.seq.is_finished else [load.seq]   # an abort while it loaded: nothing to queue

    @property
    def busy(self) -> bool:
        """Requests parked or blocks pinned for a copy: the engine has work to come back to."""
        return bool(self._parked or self._offloading)

    def attach_events(self, log: KVEventLog) -> None:
        """Report the tiers' changes to `log` from now on, and what they hold already (a disk tier
        a restarted worker found, a shared host tier other workers filled)."""
        with self._lock:
            self.host.events = log
            if isinstance(self.host, SharedHostTier):
                log.snapshot_sources[KVTier.HOST] = self.host.keys
            else:
                for key in self.host.index:
                    log.stored(KVTier.HOST, key)
            if self.disk is not None:
                self.disk.events = log
                for key in self.disk.index:
                    log.stored(KVTier.DISK, key)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def is_parked(self, seq) -> bool:
        return seq in self._parked

    def drain(self, timeout: float = 30.0) -> list:
        """Wait for every job and poll them (tests, shutdown); the requests made ready."""
        ready = []
        with self._jobs:
            self._jobs.wait_for(lambda: not self._loads and not self._offloads and not self._working, timeout)
        ready += self.poll()
        return ready

    def wait(self, timeout: float) -> None:
        """Block until a completed job waits to be polled, at most `timeout` seconds."""
        with self._jobs:
            self._jobs.wait_for(lambda: self._done or not self.busy, timeout)

    def stats(self) -> TierStats:
        with self._lock:
            disk = (len(self.disk), self.disk.limit // max(1, self._staging.nbytes)) if self.disk else (0, 0)
            return TierStats(len(self.host), self.host.capacity, *disk, self.counts["offloaded"], self.counts[HOST],
                             self.counts[DISK], self.counts["corrupt"], self.disk.recovered if self.disk else 0,
                             len(self._parked), self.load_seconds)

    def close(self) -> None:
        with self._jobs:
            self._closed = True
            self._jobs.notify_all()
        self._thread.join(timeout=10)

    # --- the tier thread -----------------------------------------------------------------
    _working = False

    def _run(self) -> None:
        while True:
            with self._jobs:
                self._jobs.wait_for(lambda: self._loads or self._offloads or self._closed)
                if self._closed:
                    return
                job = self._loads.popleft() if self._loads else self._offloads.popleft()
                self._working = True
            try:
                if isinstance(job, _Load):
                    self._load(job)
                    self._done.append(("load", job))
                else:
                    self._offload(*job)
                    self._done.append(("offload", job[0]))
            except Exception:  # noqa: BLE001 - a failed copy loses a tier's block, never a request
                log.exception("KV tier job failed")
                self._done.append(("load", job) if isinstance(job, _Load) else ("offload", job[0]))
            with self._jobs:
                self._working = False
                self._jobs.notify_all()
            if self.notify is not None:
                self.notify()

    def _offload(self, block: int, key: BlockHash) -> None:
        checksum = block_checksums(self.arena, [block])[0]
        with self._lock:
            slot = self.host.take_slot()
        target = self.host.slots[slot] if slot is not None else self._staging
        target.copy_(self.arena[:, :, block])
        with self._lock:
            if slot is not None:
                self.host.commit(key, slot, checksum)
            self.counts["offloaded"] += 1
        if self.disk is not None and key not in self.disk:
            payload = memoryview(target.view(torch.uint8).numpy()).cast("B")
            with self._lock:
                self.disk.write(key, payload, checksum)

    def _load(self, load: _Load) -> None:
        t0 = time.perf_counter()
        try:
            for key, block in zip(load.keys, load.blocks):
                tier = self._copy_in(key, block)
                if tier is None:
                    return
                load.good += 1
                load.tiers.append(tier)
        finally:
            self.load_seconds += time.perf_counter() - t0

    def _copy_in(self, key: BlockHash, block: int) -> str | None:
        """Copy `key`'s bytes into pool block `block` and check them; the tier they came from."""
        with self._lock:
            entry = self.host.get(key)
        if entry is not None:
            self.arena[:, :, block].copy_(self.host.slots[entry.where])
            if not self.host.still(entry):      # another worker of the node reused the slot mid-copy
                entry = None
        if entry is not None:
            tier = HOST
        else:
            entry = self._read_disk(key)
            if entry is None:
                return None
            self.arena[:, :, block].copy_(self._staging)
            tier = DISK
            self._promote(key, entry.checksum)
        if block_checksums(self.arena, [block])[0] != entry.checksum:
            log.warning("KV block %s from the %s tier failed its checksum: dropped, recomputed", key.hex(), tier)
            with self._lock:
                self.host.drop(key)
                if self.disk is not None:
                    self.disk.drop(key)
                self.counts["corrupt"] += 1
            return None
        return tier

    def _promote(self, key: BlockHash, checksum: int) -> None:
        """A block read from disk also goes to the host tier: the next hit is a memory copy.
        (Checked against `checksum` with the block it was loaded into; a bad one is dropped there.)"""
        with self._lock:
            slot = self.host.take_slot()
        if slot is not None:
            self.host.slots[slot].copy_(self._staging)
            with self._lock:
                self.host.commit(key, slot, checksum)

    def _read_disk(self, key: BlockHash):
        if self.disk is None:
            return None
        out = memoryview(self._staging.view(torch.uint8).numpy()).cast("B")
        with self._lock:
            return self.disk.read_into(key, out)
