"""The token data plane: deltas from a worker's engine to the frontend that owns each request.

Ray stays the orchestrator (placement, restarts, the control calls); tokens go around it. Each
frontend listens on one TCP socket (`TokenReceiver`, loopback or the node's address, never
0.0.0.0 by default). A worker's engine thread sends, once per engine step, one frame per frontend
holding every delta of that step for that frontend's requests (`TokenSender`). At concurrency 1 a
token leaves as soon as its step ends; under load one frame carries a whole batch, and a stream
whose reader lags picks up several deltas at once (`StreamQueue.take`).

Wire: each frame is a 4-byte big-endian length and a msgpack array `[version, kind, ...]`:
  hello  [1, "hello", worker_name, secret]       first frame of a connection, checked with
                                                 hmac.compare_digest before anything else is read
  step   [1, "step", [record, ...]]              record = [key, token_ids, text, finish, logprobs,
                                                 n_prompt, n_output, n_cached(, prompt_logprobs)]
                                                 (finish: "" = running; the last field only when set)
  error  [1, "error", [[key, message], ...]]     the worker failed these streams (its fault)
`key` is the frontend's number for one attempt of one request (`SinkAddress` + key travel in the
control call that starts it), so a late frame from a dead worker can never reach a retry.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import struct
from collections import deque
from dataclasses import dataclass

import msgpack

from cluster.types import FinishReason, TokenDelta, TokenLogprob

log = logging.getLogger(__name__)

STREAM_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
_LEN = struct.Struct(">I")
_FINISH = {r.value: r for r in FinishReason}


class StreamBroken(RuntimeError):
    """The worker could not deliver a stream's deltas to its frontend (the worker's side)."""


@dataclass(frozen=True)
class SinkAddress:
    """Where a frontend receives token frames. Travels to workers inside Ray control calls."""

    frontend: str
    host: str
    port: int
    secret: bytes


# --- encoding ------------------------------------------------------------------------------------
def _frame(body) -> bytes:
    data = msgpack.packb(body, use_bin_type=True)
    return _LEN.pack(len(data)) + data


def _encode_logprobs(logprobs) -> list | None:
    return [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in logprobs] if logprobs else None


def _decode_logprobs(lps) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(int(t), float(v), tuple((int(a), float(b)) for a, b in top))
                 for t, v, top in lps) if lps else ()


def encode_step(records: list[tuple[int, TokenDelta]]) -> bytes:
    out = []
    for key, d in records:
        rec = [key, list(d.token_ids), d.text, d.finish_reason.value if d.finish_reason else "",
               _encode_logprobs(d.logprobs), d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens]
        if d.prompt_logprobs:
            rec.append(_encode_logprobs(d.prompt_logprobs))
        out.append(rec)
    return _frame([STREAM_VERSION, "step", out])


def encode_errors(errors: list[tuple[int, str]]) -> bytes:
    return _frame([STREAM_VERSION, "error", [[k, m] for k, m in errors]])


def decode_record(rec, request_id: str) -> TokenDelta:
    key, ids, text, finish, lps, n_prompt, n_output, n_cached = rec[:8]
    return TokenDelta(request_id, tuple(ids), text, _FINISH[finish] if finish else None, _decode_logprobs(lps),
                      n_prompt, n_output, n_cached, _decode_logprobs(rec[8]) if len(rec) > 8 else ())


# --- worker side ---------------------------------------------------------------------------------
class TokenSender:
    """A worker's connections to frontends, opened on first use. Used from the engine thread only:
    sends are blocking with a timeout, so a frontend that stops reading cannot stall the engine
    for longer than `timeout_s` (its streams then fail and are aborted)."""

    def __init__(self, worker_name: str, timeout_s: float = 10.0):
        self.worker_name = worker_name
        self.timeout_s = timeout_s
        self._socks: dict[SinkAddress, socket.socket] = {}

    def _connect(self, sink: SinkAddress) -> socket.socket:
        sock = self._socks.get(sink)
        if sock is None:
            sock = socket.create_connection((sink.host, sink.port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_frame([STREAM_VERSION, "hello", self.worker_name, sink.secret]))
            self._socks[sink] = sock
        return sock

    def send(self, sink: SinkAddress, frame: bytes) -> bool:
        try:
            self._connect(sink).sendall(frame)
            return True
        except OSError as exc:
            log.warning("token stream to frontend %s at %s:%d broke: %s", sink.frontend, sink.host, sink.port, exc)
            self._drop(sink)
            return False

    def _drop(self, sink: SinkAddress) -> None:
        sock = self._socks.pop(sink, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for sink in list(self._socks):
            self._drop(sink)


# --- frontend side -------------------------------------------------------------------------------
class StreamQueue:
    """One attempt's deltas, filled by the receiver and drained by the frontend's RPC handler. A
    cheap single-consumer queue: `take` returns everything that has arrived, so a handler that
    lags coalesces deltas instead of waking once per token."""

    __slots__ = ("request_id", "items", "waiter")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def push(self, item) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out = list(self.items)
        self.items.clear()
        return out


class _SharedQueue:
    """Another request's entry into a `StreamQueue` (see `TokenReceiver.open`)."""

    __slots__ = ("request_id", "queue")

    def __init__(self, request_id: str, queue: StreamQueue):
        self.request_id = request_id
        self.queue = queue

    def push(self, item) -> None:
        self.queue.push(item)


class _Connection(asyncio.Protocol):
    def __init__(self, receiver: "TokenReceiver"):
        self.receiver = receiver
        self.buf = bytearray()
        self.worker: str | None = None
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.receiver.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.receiver.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 4:
            (n,) = _LEN.unpack_from(self.buf)
            if n > MAX_FRAME_BYTES or (self.worker is None and n > 4096):
                log.warning("token stream: refusing a %d-byte frame from %s", n, self.worker or "an unknown peer")
                self.transport.close()
                return
            if len(self.buf) < 4 + n:
                return
            body = bytes(self.buf[4:4 + n])
            del self.buf[:4 + n]
            if not self._on_frame(body):
                self.transport.close()
                return

    def _on_frame(self, body: bytes) -> bool:
        try:
            msg = msgpack.unpackb(body, raw=False)
            version, kind = msg[0], msg[1]
        except Exception:  # noqa: BLE001 - malformed: never trusted
            return False
        if version != STREAM_VERSION:
            log.warning("token stream: version %r, expected %d", version, STREAM_VERSION)
            return False
        if self.worker is None:
            if kind != "hello" or not isinstance(msg[3], bytes) or not hmac.compare_digest(msg[3], self.receiver.secret):
                log.warning("token stream: a peer failed the hello; closing")
                return False
            self.worker = str(msg[2])
            return True
        try:
            if kind == "step":
                self.receiver.deliver(msg[2])
            elif kind == "error":
                self.receiver.fail(msg[2])
        except Exception:  # noqa: BLE001 - a bad record drops the connection, not the frontend
            log.exception("token stream: bad frame from %s", self.worker)
            return False
        return True


class TokenReceiver:
    """A frontend's listener: routes each record to the `StreamQueue` registered for its key."""

    def __init__(self, frontend: str, host: str = "127.0.0.1"):
        self.frontend = frontend
        self.host = host
        self.secret = os.urandom(32)
        self.queues: dict[int, StreamQueue] = {}
        self.connections: set[_Connection] = set()
        self._next_key = 0
        self.server: asyncio.AbstractServer | None = None
        self.address: SinkAddress | None = None

    async def start(self) -> SinkAddress:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Connection(self), self.host, 0)
        port = self.server.sockets[0].getsockname()[1]
        self.address = SinkAddress(self.frontend, self.host, port, self.secret)
        return self.address

    def open(self, request_id: str, shared: StreamQueue | None = None) -> tuple[int, StreamQueue]:
        """A key for one attempt of `request_id`. With `shared`, its deltas go into that queue (the
        samples of one prompt, read together), each still named by its own request id."""
        self._next_key += 1
        q = StreamQueue(request_id) if shared is None else _SharedQueue(request_id, shared)
        self.queues[self._next_key] = q
        return self._next_key, (q if shared is None else shared)

    def close_key(self, key: int) -> None:
        self.queues.pop(key, None)

    def deliver(self, records) -> None:
        queues = self.queues
        for rec in records:
            q = queues.get(rec[0])
            if q is not None:       # unknown: an attempt already given up (e.g. after a failover)
                q.push(decode_record(rec, q.request_id))

    def fail(self, errors) -> None:
        for key, message in errors:
            q = self.queues.get(key)
            if q is not None:
                q.push(StreamBroken(str(message)))

    async def stop(self) -> None:
        """Stop listening and drop every worker's connection (their streams to us then fail)."""
        if self.server is not None:
            self.server.close()
            for conn in list(self.connections):
                conn.transport.abort()
            await self.server.wait_closed()
