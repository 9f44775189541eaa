"""Authentication of the KV plane with the cluster secret: every handshake and every control
message between workers carries an HMAC-SHA256, verified before anything is decoded or allocated.

A sealed message is `version (1) | nonce (16) | time in ms (8) | body | mac (32)`, the MAC over a
context label (what the bytes are for: a message of one kind can never pass for another), the
header and the body. Opening checks the size bound first, then the MAC (constant time), then the
time (within `window_s` of ours) and, for messages that must not be replayed, that the nonce is
new: a replayed DONE or ABORT is refused and changes nothing. Peer metadata is sealed without the
replay check, because the driver re-sends the same metadata on reconnects (adding it twice is a
no-op by design); it is still authenticated.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time

VERSION = 1
_HEADER = struct.Struct("!B16sQ")
MAC_BYTES = 32
OVERHEAD = _HEADER.size + MAC_BYTES


class Sealer:
    def __init__(self, secret: bytes, window_s: float = 300.0, max_remembered: int = 200_000):
        if len(secret) < 16:
            raise ValueError("the cluster secret must have at least 16 bytes")
        self._key = hashlib.sha256(b"splitserve-kv-plane/" + secret).digest()
        self.window_s = window_s
        self.max_remembered = max_remembered
        self._seen: dict[bytes, float] = {}     # nonce -> when it expires (monotonic)
        self._lock = threading.Lock()           # transports open from their own threads

    def seal(self, context: bytes, body: bytes) -> bytes:
        header = _HEADER.pack(VERSION, os.urandom(16), int(time.time() * 1000))
        return header + body + hmac.new(self._key, context + header + body, hashlib.sha256).digest()

    def open(self, context: bytes, data: bytes, max_body: int, replay: bool = True) -> bytes | None:
        """The body, or None for anything not sealed by a holder of the secret, too large, too
        old or (with `replay`) seen before."""
        if not isinstance(data, (bytes, bytearray, memoryview)) or not OVERHEAD <= len(data) <= OVERHEAD + max_body:
            return None
        data = bytes(data)
        header, body, mac = data[:_HEADER.size], data[_HEADER.size:-MAC_BYTES], data[-MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._key, context + header + body, hashlib.sha256).digest()):
            return None
        version, nonce, ms = _HEADER.unpack(header)
        if version != VERSION or abs(time.time() - ms / 1000) > self.window_s:
            return None
        if replay and not self._first_use(nonce):
            return None
        return body

    def _first_use(self, nonce: bytes) -> bool:
        now = time.monotonic()
        with self._lock:
            if nonce in self._seen:
                return False
            if len(self._seen) >= self.max_remembered:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                if len(self._seen) >= self.max_remembered:
                    return False        # flooded with valid messages: refuse rather than forget
            # A nonce older than the window is refused by its time; remember it a little longer.
            self._seen[nonce] = now + 2 * self.window_s
            return True
