"""Control messages between producer and consumer, carried by the transport's notifications."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgpack


class Kind(str, enum.Enum):
    RENEW = "renew"      # consumer -> producer: still alive and waiting; extend the lease
    DONE = "done"        # consumer -> producer: read and verified; release, then ack
    FAIL = "fail"        # consumer -> producer: giving up (verification failed, timeout); release
    ABORT = "abort"      # either way: the request is aborted; release everything
    ACK = "ack"          # producer -> consumer: answer to DONE; ok=False when the lease had ended
    PUSHED = "pushed"    # producer -> consumer: every layer written (push mode), with checksums


@dataclass(frozen=True)
class Message:
    kind: Kind
    lease_id: str
    ok: bool = True
    reason: str = ""
    checksums: tuple[int, ...] = field(default=())
    first_token: int = -1

    def encode(self) -> bytes:
        return msgpack.packb({"k": self.kind.value, "l": self.lease_id, "ok": self.ok, "r": self.reason,
                              "c": list(self.checksums), "f": self.first_token})

    @classmethod
    def decode(cls, data: bytes) -> "Message | None":
        try:
            raw = msgpack.unpackb(data)
            return cls(Kind(raw["k"]), str(raw["l"]), bool(raw["ok"]), str(raw["r"]),
                       tuple(int(c) for c in raw["c"]), int(raw["f"]))
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            return None   # not ours or malformed: ignored, never trusted


class Mailbox:
    """One reader of a transport's notifications, shared by the producer and the consumer of a
    worker: each takes the messages of its own leases. A message that arrives before its lease is
    known (PUSHED racing `expect_push`) waits here for `ttl_s`."""

    def __init__(self, transport, ttl_s: float = 60.0):
        self.transport = transport
        self.ttl_s = ttl_s
        self.pending: list[tuple[float, str, Message]] = []

    def take(self, wanted) -> list[tuple[str, Message]]:
        import time  # noqa: PLC0415
        now = time.monotonic()
        for peer, data in self.transport.notifications():
            msg = Message.decode(data)
            if msg is not None:
                self.pending.append((now, peer, msg))
        taken, kept = [], []
        for entry in self.pending:
            if wanted(entry[2]):
                taken.append((entry[1], entry[2]))
            elif now - entry[0] < self.ttl_s:
                kept.append(entry)
        self.pending = kept
        return taken
