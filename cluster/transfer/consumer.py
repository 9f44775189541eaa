"""The decode side of a KV handoff.

Pull: `start_pull(handle, local_blocks)` reads the producer's blocks into blocks the caller took
from its own pool, verifies the checksums, sends DONE and waits for the producer's ACK; only then
is the pull DONE and may the sequence join the batch.

Every state has a deadline: a dead or silent producer turns a pull into FAILED within
`timeout_s`. A pull is never reported finished while a read may still land in its blocks, so the
caller can free them (FAILED) or hand them to the engine (DONE) at once.

Thread-safe: a worker polls its consumer on its KV progress thread (cluster/transfer/progress.py)
while the engine thread starts, declines and aborts pulls.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cluster.transfer.base import LayoutMismatch, PollBackoff, Transfer, TransferStatus, Transport
from cluster.transfer.checksum import block_checksums
from cluster.transfer.messages import Kind, Mailbox, Message
from cluster.types import KVHandle, KVLayout

log = logging.getLogger(__name__)


class PullState(enum.Enum):
    READING = "reading"          # pull: read posted
    CONFIRMING = "confirming"    # verified, DONE sent, waiting for ACK
    DONE = "done"
    FAILED = "failed"


@dataclass
class KVPull:
    lease_id: str
    producer: str
    local_blocks: list[int]
    checksums: tuple[int, ...]
    deadline: float
    state: PullState
    handle: KVHandle | None = None
    transfer: Transfer | None = None
    error: str = ""
    next_renew: float = 0.0
    timings: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state in (PullState.DONE, PullState.FAILED)


class KVConsumer:
    def __init__(self, transport: Transport, layout: KVLayout, arena: torch.Tensor, timeout_s: float = 10.0,
                 verify: bool = True, clock: Callable[[], float] = time.monotonic,
                 mailbox: Mailbox | None = None, on_work: Callable[[], None] = lambda: None):
        """`on_work`: called when a pull starts or a message must go out (the worker wakes its
        progress thread, which polls while a pull is in flight)."""
        self.transport = transport
        self.layout_hash = layout.layout_hash()
        self.arena = arena
        self.timeout_s = timeout_s
        self.verify = verify
        self.clock = clock
        self.pulls: dict[str, KVPull] = {}
        self.mailbox = mailbox or Mailbox(transport)
        self.backoff = PollBackoff()
        self._progressed = False
        self.on_work = on_work
        self._lock = threading.RLock()

    def _wants(self, msg: Message) -> bool:
        return msg.kind in (Kind.ACK, Kind.ABORT, Kind.FAIL) and msg.lease_id in self.pulls

    def start_pull(self, handle: KVHandle, local_blocks) -> KVPull:
        if handle.layout_hash != self.layout_hash:
            raise LayoutMismatch(f"handle {handle.lease_id} has layout {handle.layout_hash}, ours is "
                                 f"{self.layout_hash}: the producer's KV cannot be read here")
        if len(local_blocks) != len(handle.block_ids):
            raise ValueError(f"need {len(handle.block_ids)} local blocks, got {len(local_blocks)}")
        now = self.clock()
        pull = KVPull(handle.lease_id, handle.producer, list(local_blocks), handle.checksums,
                      now + self.timeout_s, PullState.READING, handle=handle,
                      next_renew=now + handle.lease_seconds / 3)
        pull.timings["start"] = time.perf_counter()
        with self._lock:
            pull.transfer = self.transport.read(handle.producer, handle.block_ids, pull.local_blocks)
            self.pulls[pull.lease_id] = pull
        self.on_work()
        return pull

    def decline(self, handle: KVHandle, reason: str) -> None:
        """Refuse a handle before any pull starts (no room, a bad layout): the producer ends its
        lease and releases its pins at once instead of holding them until the lease expires."""
        self.mailbox.send(handle.producer, Message(Kind.FAIL, handle.lease_id, ok=False, reason=reason))

    def abort(self, lease_id: str) -> None:
        """Abort from the decode side: the producer releases; our blocks are freed by the caller
        once the pull is reported FAILED (after any read in flight has stopped)."""
        with self._lock:
            pull = self.pulls.get(lease_id)
            if pull is None or pull.finished:
                return
            self._give_up(pull, Message(Kind.ABORT, lease_id), "aborted")
        self.on_work()             # the progress thread reports it FAILED

    def _give_up(self, pull: KVPull, msg: Message, reason: str) -> None:
        """End a handoff from our side: tell the producer (it releases its pins), then fail."""
        self.mailbox.send(pull.producer, msg)
        self._fail(pull, reason)

    def poll(self) -> list[KVPull]:
        """Advance every pull; returns those that finished in this call."""
        with self._lock:
            return self._poll()

    def _poll(self) -> list[KVPull]:
        for peer, msg in self.mailbox.take(self._wants):
            pull = self.pulls.get(msg.lease_id)
            if pull is None or pull.finished or peer != pull.producer:
                continue
            self._progressed = True
            self._on_message(pull, msg)
        now = self.clock()
        for pull in list(self.pulls.values()):
            if pull.state is PullState.READING:
                self._progress_read(pull)
            if not pull.finished and now > pull.deadline:
                self._give_up(pull, Message(Kind.FAIL, pull.lease_id, ok=False, reason="timeout"),
                              f"timed out in state {pull.state.value} after {self.timeout_s:.1f}s")
            elif not pull.finished and now >= pull.next_renew:
                pull.next_renew = now + pull.handle.lease_seconds / 3
                self.mailbox.send(pull.producer, Message(Kind.RENEW, pull.lease_id))
        done = [p for p in self.pulls.values() if p.finished]
        for p in done:
            del self.pulls[p.lease_id]
        return done

    def wait(self, pull: KVPull, timeout_s: float | None = None) -> KVPull:
        """Blocking helper: poll until `pull` finishes (its own deadline bounds the wait)."""
        limit = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s + 1)
        while not pull.finished and time.monotonic() < limit:
            self.poll()
            if not pull.finished:
                time.sleep(0.0005)
        if not pull.finished:
            self._fail(pull, "wait timed out")
            self.pulls.pop(pull.lease_id, None)
        return pull

    def poll_interval(self) -> float | None:
        """Seconds until the next `poll` is due; None when no pull is in flight."""
        with self._lock:
            progressed, self._progressed = self._progressed, False
            return self.backoff.next(bool(self.pulls), progressed)

    def _progress_read(self, pull: KVPull) -> None:
        status = self.transport.poll(pull.transfer)
        if status is TransferStatus.PENDING:
            return
        self._progressed = True
        self.transport.release(pull.transfer)
        pull.transfer = None
        pull.timings["read"] = time.perf_counter()
        if status is TransferStatus.FAILED:
            self.mailbox.send(pull.producer, Message(Kind.FAIL, pull.lease_id, ok=False, reason="read"))
            self._fail(pull, "read failed")
            return
        self._verify_and_confirm(pull)

    def _verify_and_confirm(self, pull: KVPull) -> None:
        if self.verify and pull.checksums:
            got = block_checksums(self.arena, pull.local_blocks)
            pull.timings["verified"] = time.perf_counter()
            bad = [i for i, (a, b) in enumerate(zip(got, pull.checksums)) if a != b]
            if bad:
                self.mailbox.send(pull.producer, Message(Kind.FAIL, pull.lease_id, ok=False,
                                                             reason="checksum"))
                self._fail(pull, f"checksum mismatch in {len(bad)} of {len(got)} blocks (first: block {bad[0]})")
                return
        pull.state = PullState.CONFIRMING
        self.mailbox.send(pull.producer, Message(Kind.DONE, pull.lease_id))

    def _on_message(self, pull: KVPull, msg: Message) -> None:
        if msg.kind is Kind.ACK and pull.state is PullState.CONFIRMING:
            if msg.ok:
                pull.state = PullState.DONE
                pull.timings["acked"] = time.perf_counter()
            else:
                self._fail(pull, f"producer says the lease had ended ({msg.reason}); the copy is void")
        elif msg.kind in (Kind.ABORT, Kind.FAIL):
            self._fail(pull, f"producer ended the handoff ({msg.kind.value}{': ' + msg.reason if msg.reason else ''})")

    def _fail(self, pull: KVPull, reason: str) -> None:
        if pull.transfer is not None:
            # Never hand blocks back while a read may still land in them.
            limit = time.monotonic() + 2.0
            while self.transport.poll(pull.transfer) is TransferStatus.PENDING and time.monotonic() < limit:
                time.sleep(0.001)
            self.transport.release(pull.transfer)
            pull.transfer = None
        pull.state = PullState.FAILED
        pull.error = reason
        log.warning("KV handoff %s failed: %s", pull.lease_id, reason)
