"""Control messages between producer and consumer, carried by the transport's notifications."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import msgpack


class Kind(str, enum.Enum):
    RENEW = "renew"      # consumer -> producer: still alive and waiting; extend the lease
    DONE = "done"        # consumer -> producer: read and verified; release, then ack
    FAIL = "fail"        # consumer -> producer: giving up (verification failed, timeout); release
    ABORT = "abort"      # either way: the request is aborted; release everything
    ACK = "ack"          # producer -> consumer: answer to DONE; ok=False when the lease had ended


@dataclass(frozen=True)
class Message:
    kind: Kind
    lease_id: str
    ok: bool = True
    reason: str = ""

    def encode(self) -> bytes:
        return msgpack.packb({"k": self.kind.value, "l": self.lease_id, "ok": self.ok, "r": self.reason})

    @classmethod
    def decode(cls, data: bytes) -> "Message | None":
        """Strict: exact keys and types, bounded strings; anything else is None (never trusted)."""
        try:
            raw = msgpack.unpackb(data, max_bin_len=0, max_str_len=4096, max_array_len=1 << 16, max_map_len=8)
        except Exception:  # noqa: BLE001 - msgpack raises several kinds on garbage
            return None
        if not isinstance(raw, dict) or set(raw) != {"k", "l", "ok", "r"}:
            return None
        lease, ok, reason = raw["l"], raw["ok"], raw["r"]
        if not (isinstance(lease, str) and 0 < len(lease) <= 128 and isinstance(ok, bool)
                and isinstance(reason, str)):
            return None
        try:
            return cls(Kind(raw["k"]), lease, ok, reason)
        except ValueError:
            return None


MAX_MESSAGE_BYTES = 1 << 20      # far above any message: a bound on what is decoded at all
_CONTEXT = b"kv-message"


class Mailbox:
    """One reader of a transport's notifications, shared by the producer and the consumer of a
    worker: each takes the messages of its own leases. A message that no lease wants yet waits
    here for `ttl_s`. With a `sealer` (the cluster
    secret, cluster/transfer/auth.py) every message sent is sealed and every one received must
    open: a forged, replayed or oversized one is dropped before it is decoded."""

    def __init__(self, transport, ttl_s: float = 60.0, sealer=None, max_pending: int = 10_000):
        self.transport = transport
        self.ttl_s = ttl_s
        self.sealer = sealer
        self.max_pending = max_pending
        self.pending: list[tuple[float, str, Message]] = []
        self.refused = 0             # notifications that did not open (forged, replayed, malformed)

    def send(self, peer: str, msg: Message) -> None:
        data = msg.encode()
        self.transport.notify(peer, self.sealer.seal(_CONTEXT, data) if self.sealer is not None else data)

    def _open(self, data: bytes) -> Message | None:
        if self.sealer is not None:
            data = self.sealer.open(_CONTEXT, data, MAX_MESSAGE_BYTES)
            if data is None:
                return None
        elif len(data) > MAX_MESSAGE_BYTES:
            return None
        return Message.decode(data)

    def take(self, wanted) -> list[tuple[str, Message]]:
        now = time.monotonic()
        for peer, data in self.transport.notifications():
            msg = self._open(data)
            if msg is None:
                self.refused += 1
            elif len(self.pending) < self.max_pending:
                self.pending.append((now, peer, msg))
        taken, kept = [], []
        for entry in self.pending:
            if wanted(entry[2]):
                taken.append((entry[1], entry[2]))
            elif now - entry[0] < self.ttl_s:
                kept.append(entry)
        self.pending = kept
        return taken
