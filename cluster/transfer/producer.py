"""The prefill side of a KV handoff: pins a request's blocks under a lease and releases them on
every path — the consumer is done, either side aborts, the consumer fails, or the lease expires.

Pull (default): `publish` returns a KVHandle; the consumer reads the blocks, verifies them and
sends DONE; the producer answers ACK(ok) only if the lease was still active, and releases. A
consumer that read from an expired lease is told ACK(ok=False) and discards what it read, so an
expired or aborted handle can never be read into a live sequence.

The producer keeps only the wire protocol (checksums, the mailbox, deadlines): which blocks a lease
pins is its owner's (prefill/handoff.py `PrefillHandoff`), told of each lease's end by `on_lease_end`.

Thread-safe: a worker polls its producer on its KV progress thread (cluster/transfer/progress.py)
while the engine thread publishes and aborts. `on_lease_end` may run on either thread, under the
producer's lock: it must not block (the prefill worker hands the free to its engine thread).
"""
from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.transfer.base import PollBackoff, Transport
from cluster.transfer.checksum import block_checksums
from cluster.transfer.messages import Kind, Mailbox, Message
from cluster.types import KVHandle, KVLayout

log = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    ACTIVE = "active"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"


@dataclass
class Lease:
    """The wire side of a lease: whose it is, its deadline and its bound consumer (the blocks it
    pins are its owner's record)."""
    lease_id: str
    request_id: str
    deadline: float
    state: LeaseState = LeaseState.ACTIVE
    consumer: str | None = None


class KVProducer:
    def __init__(self, transport: Transport, layout: KVLayout, arena: torch.Tensor,
                 on_lease_end: Callable[[str, LeaseState], None], lease_seconds: float = 30.0,
                 checksums: bool = True, clock: Callable[[], float] = time.monotonic,
                 mailbox: Mailbox | None = None, on_work: Callable[[], None] = lambda: None):
        """`on_work`: called when a lease starts (the worker wakes its
        progress thread, which polls while a lease is live)."""
        self.transport = transport
        self.layout = layout
        self.layout_hash = layout.layout_hash()
        self.arena = arena
        self.on_lease_end = on_lease_end          # called once per lease: (request id, final state)
        self.lease_seconds = lease_seconds
        self.checksums = checksums
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.ended: dict[str, LeaseState] = {}    # lease id -> final state (for late messages)
        self.checksum_seconds = 0.0
        self.mailbox = mailbox or Mailbox(transport)
        self.backoff = PollBackoff()
        self._progressed = False
        self.on_work = on_work
        self._lock = threading.RLock()

    def _wants(self, msg: Message) -> bool:
        if msg.kind is Kind.ACK:
            return False
        return msg.lease_id in self.leases or msg.lease_id in self.ended

    def _new_lease(self, request_id: str) -> Lease:
        lease = Lease(uuid.uuid4().hex, request_id, self.clock() + self.lease_seconds)
        self.leases[lease.lease_id] = lease
        return lease

    def _checksums(self, blocks) -> tuple[int, ...]:
        if not self.checksums:
            return ()
        t0 = time.perf_counter()
        out = tuple(block_checksums(self.arena, blocks))
        self.checksum_seconds += time.perf_counter() - t0
        return out

    # --- pull ----------------------------------------------------------------------------
    def publish(self, request_id: str, block_ids, num_tokens: int, first_token: int) -> KVHandle:
        # The checksums first: a lease exists only once its handle is complete, so a failure in
        # between pins nothing for the lease time.
        checksums = self._checksums(block_ids)
        with self._lock:
            lease = self._new_lease(request_id)
        self.on_work()
        return KVHandle(request_id=request_id, producer=self.transport.agent_name, lease_id=lease.lease_id,
                        block_ids=tuple(block_ids), num_tokens=num_tokens, first_token=int(first_token),
                        layout_hash=self.layout_hash, checksums=checksums, lease_seconds=self.lease_seconds)

    # --- the loop ------------------------------------------------------------------------
    def poll(self) -> None:
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        for peer, msg in self.mailbox.take(self._wants):
            self._progressed = True
            self._on_message(peer, msg)
        now = self.clock()
        for lease in list(self.leases.values()):
            if now > lease.deadline:
                log.warning("lease %s of request %s expired; releasing its blocks", lease.lease_id,
                            lease.request_id)
                self._end(lease, LeaseState.EXPIRED)

    def _on_message(self, peer: str, msg: Message) -> None:
        lease = self.leases.get(msg.lease_id)
        if lease is None:
            if msg.kind is Kind.DONE:   # too late: tell the consumer its copy is void
                state = self.ended.get(msg.lease_id, LeaseState.EXPIRED)
                self.mailbox.send(peer, Message(Kind.ACK, msg.lease_id, ok=False, reason=state.value))
            return
        if lease.consumer is None:
            lease.consumer = peer
        elif lease.consumer != peer:
            log.warning("ignoring %s for lease %s from %s (bound to %s)", msg.kind.value, msg.lease_id, peer,
                        lease.consumer)
            return
        if msg.kind is Kind.RENEW:
            lease.deadline = self.clock() + self.lease_seconds
        elif msg.kind is Kind.DONE and lease.state is LeaseState.ACTIVE:
            self._end(lease, LeaseState.DONE)
            self.mailbox.send(peer, Message(Kind.ACK, msg.lease_id, ok=True))
        elif msg.kind in (Kind.FAIL, Kind.ABORT):
            self._end(lease, LeaseState.ABORTED if msg.kind is Kind.ABORT else LeaseState.FAILED)

    def abort(self, request_id: str) -> bool:
        """The prefill side aborts: release at once and tell a known consumer."""
        found = False
        with self._lock:
            for lease in list(self.leases.values()):
                if lease.request_id == request_id:
                    found = True
                    if lease.consumer:
                        self.mailbox.send(lease.consumer, Message(Kind.ABORT, lease.lease_id))
                    self._end(lease, LeaseState.ABORTED)
        return found

    def _end(self, lease: Lease, state: LeaseState) -> None:
        lease.state = state
        del self.leases[lease.lease_id]
        self.ended[lease.lease_id] = state
        if len(self.ended) > 10000:
            self.ended.pop(next(iter(self.ended)))
        self.on_lease_end(lease.request_id, state)

    def poll_interval(self) -> float | None:
        """Seconds until the next `poll` is due; None when no lease is live (nothing to wait for:
        lease deadlines only matter while a lease exists)."""
        with self._lock:
            progressed, self._progressed = self._progressed, False
            return self.backoff.next(bool(self.leases), progressed)

    def num_active(self) -> int:
        with self._lock:
            return len(self.leases)
