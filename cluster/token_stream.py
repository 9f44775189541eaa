"""The token data plane: deltas from a worker's engine to the frontend that owns each request.

Ray stays the orchestrator (placement, restarts, the control calls); tokens go around it. Each
frontend listens on one TCP socket (`TokenReceiver`, loopback or the node's address, never
0.0.0.0 by default). A worker's engine thread sends, once per engine step, one frame per frontend
holding every delta of that step for that frontend's requests (`TokenSender`). At concurrency 1 a
token leaves as soon as its step ends; under load one frame carries a whole batch, and a stream
whose reader lags picks up several deltas at once (`StreamQueue.take`).

Wire (version 3): each frame is a 4-byte big-endian length and a msgpack array `[version, kind, body]`:
  hello  [3, "hello", [worker_name, secret]]    first frame of a connection, checked with
                                                hmac.compare_digest before anything else is read
  step   [3, "step", [record, ...]]             record = [key, token_ids, text, finish, logprobs,
                                                n_prompt, n_output, n_cached, prompt_logprobs]
                                                (finish: "" = running; logprobs: nil or a list)
  error  [3, "error", [[key, message], ...]]    the worker failed these streams (its fault)
  stats  [3, "stats", {field: value, ...}]      the worker's `WorkerStats` (cluster/worker_messages.py),
                                                pushed at most every `STATS_PUSH_S` while it steps
Every frame is decoded strictly into its dataclass (`Hello`, `StepFrame` of `StepRecord`s,
`ErrorFrame`, `StatsFrame`): another version, a field of the wrong type or a missing one is a `FrameError`
naming it; the receiver counts it (`TokenReceiver.refused`), fails the streams the frame was for
and drops that connection, never itself. Records are fixed-order arrays, not maps: one frame per
step per frontend stays cheap to build and to read.
Stats ride the same connections: a busy worker's load reaches the router with its tokens, and the
router's Ray poll of that worker drops to the idle cadence (router/stats_poll.py `StatsCadence`).
Version 3 added the stats kind.
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

STREAM_VERSION = 3
STATS_PUSH_S = 0.25     # a stepping worker pushes its stats at most this often
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


# --- frames ---------------------------------------------------------------------------------------
class FrameError(ValueError):
    """A frame this version of the protocol does not send; `keys`: the streams it was for (as far
    as they could be read), failed at once rather than left waiting."""

    def __init__(self, message: str, keys: tuple[int, ...] = ()):
        super().__init__(message)
        self.keys = keys


@dataclass(frozen=True, slots=True)
class Hello:
    worker: str
    secret: bytes


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One request's delta of one step, named by its stream key (the frontend knows the request id)."""
    key: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprob, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    prompt_logprobs: tuple[TokenLogprob, ...]

    def delta(self, request_id: str) -> TokenDelta:
        return TokenDelta(request_id, self.token_ids, self.text, self.finish_reason, self.logprobs,
                          self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens,
                          self.prompt_logprobs)


@dataclass(frozen=True, slots=True)
class StepFrame:
    records: tuple[StepRecord, ...]


@dataclass(frozen=True, slots=True)
class StreamError:
    key: int
    message: str


@dataclass(frozen=True, slots=True)
class KeyedDelta:
    """What a worker sends of one request in a step: its delta under the attempt's stream key."""
    key: int
    delta: TokenDelta


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    errors: tuple[StreamError, ...]


@dataclass(frozen=True, slots=True)
class StatsFrame:
    """A worker's stats as sent: a map, read strictly by the receiver's `on_stats`."""
    body: dict


Frame = Hello | StepFrame | ErrorFrame | StatsFrame


def _frame(kind: str, body) -> bytes:
    data = msgpack.packb([STREAM_VERSION, kind, body], use_bin_type=True)
    return _LEN.pack(len(data)) + data


def _encode_logprobs(logprobs) -> list | None:
    return [[int(lp.token_id), float(lp.logprob), [[int(a), float(b)] for a, b in lp.top]]
            for lp in logprobs] if logprobs else None


def encode_hello(worker_name: str, secret: bytes) -> bytes:
    return _frame("hello", [worker_name, secret])


def encode_step(records: list[KeyedDelta]) -> bytes:
    return _frame("step", [_step_record(r.key, r.delta) for r in records])


def _step_record(key: int, d: TokenDelta) -> list:
    return [key, list(d.token_ids), d.text, d.finish_reason.value if d.finish_reason else "",
            _encode_logprobs(d.logprobs), d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens,
            _encode_logprobs(d.prompt_logprobs)]


def encode_errors(errors: list[StreamError]) -> bytes:
    return _frame("error", [[e.key, e.message] for e in errors])


def encode_stats(body: dict) -> bytes:
    return _frame("stats", body)


def decode_frame(data: bytes) -> Frame:
    """One frame's body, strictly: `FrameError` for anything but a frame of this version."""
    try:
        msg = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds on garbage
        raise FrameError(f"not msgpack ({type(exc).__name__})") from None
    if type(msg) is not list or len(msg) != 3:
        raise FrameError("not a [version, kind, body] array")
    version, kind, body = msg
    if version != STREAM_VERSION:
        raise FrameError(f"version {version!r}; this receiver reads version {STREAM_VERSION}")
    if kind == "step":
        return StepFrame(_records(body))
    if kind == "error":
        return ErrorFrame(_errors(body))
    if kind == "stats":
        _need(type(body) is dict, "stats: a map")
        return StatsFrame(body)
    if kind == "hello":
        _need(type(body) is list and len(body) == 2 and type(body[0]) is str and type(body[1]) is bytes,
              "hello: [worker name, secret bytes]")
        return Hello(body[0], body[1])
    raise FrameError(f"unknown kind {kind!r}")


def _need(ok: bool, what: str, keys: tuple[int, ...] = ()) -> None:
    if not ok:
        raise FrameError(what, keys)


def _is_int(v) -> bool:
    return type(v) is int


def _records(body) -> tuple[StepRecord, ...]:
    _need(type(body) is list, "step: a list of records")
    try:
        return tuple(_record(rec) for rec in body)
    except FrameError as exc:
        keys = tuple(r[0] for r in body if type(r) is list and r and _is_int(r[0]))
        raise FrameError(f"step record: {exc}", keys) from None


def _record(rec) -> StepRecord:
    _need(type(rec) is list and len(rec) == 9, "an array of 9 fields")
    key, ids, text, finish, lps, n_prompt, n_output, n_cached, plps = rec
    _need(_is_int(key), "key: an integer")
    _need(type(ids) is list and all(_is_int(t) for t in ids), "token_ids: a list of integers")
    _need(type(text) is str, "text: a string")
    _need(type(finish) is str and (finish == "" or finish in _FINISH), f"finish: one of {sorted(_FINISH)} or \"\"")
    _need(_is_int(n_prompt) and _is_int(n_output) and _is_int(n_cached), "counts: integers")
    return StepRecord(key, tuple(ids), text, _FINISH[finish] if finish else None, _logprobs(lps, "logprobs"),
                      n_prompt, n_output, n_cached, _logprobs(plps, "prompt_logprobs"))


def _logprobs(lps, name: str) -> tuple[TokenLogprob, ...]:
    if lps is None:
        return ()
    _need(type(lps) is list, f"{name}: nil or a list")
    out = []
    for entry in lps:
        _need(type(entry) is list and len(entry) == 3, f"{name}: [token id, logprob, top] entries")
        token, logprob, top = entry
        _need(_is_int(token) and type(logprob) is float and type(top) is list, f"{name}: [int, float, list] entries")
        _need(all(type(t) is list and len(t) == 2 and _is_int(t[0]) and type(t[1]) is float for t in top),
              f"{name}: top entries [token id, logprob]")
        out.append(TokenLogprob(token, logprob, tuple((a, b) for a, b in top)))
    return tuple(out)


def _errors(body) -> tuple[StreamError, ...]:
    _need(type(body) is list and all(type(e) is list and len(e) == 2 and _is_int(e[0]) and type(e[1]) is str
                                     for e in body), "error: a list of [key, message]")
    return tuple(StreamError(k, m) for k, m in body)


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
            sock.sendall(encode_hello(self.worker_name, sink.secret))
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
                self.receiver.refuse(self.worker, FrameError(f"a {n}-byte frame, over the limit"))
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
            frame = decode_frame(body)
        except FrameError as exc:       # never trusted: counted, its streams failed, the peer dropped
            self.receiver.refuse(self.worker, exc)
            return False
        if self.worker is None:
            if type(frame) is not Hello or not hmac.compare_digest(frame.secret, self.receiver.secret):
                self.receiver.refuse(None, FrameError("the first frame is not a hello with this frontend's secret"))
                return False
            self.worker = frame.worker
            return True
        if type(frame) is StepFrame:
            self.receiver.deliver(frame.records)
        elif type(frame) is ErrorFrame:
            self.receiver.fail(frame.errors)
        elif type(frame) is StatsFrame:
            return self.receiver.stats(self.worker, frame.body)
        else:
            self.receiver.refuse(self.worker, FrameError("a second hello"))
            return False
        return True


class TokenReceiver:
    """A frontend's listener: routes each record to the `StreamQueue` registered for its key."""

    def __init__(self, frontend: str, host: str = "127.0.0.1", on_stats=None):
        """`on_stats(worker, body)`: a stats frame from `worker` (its name as its hello gave it);
        raises ValueError for a body it refuses (the frame is then refused as any bad frame)."""
        self.frontend = frontend
        self.on_stats = on_stats
        self.host = host
        self.secret = os.urandom(32)
        self.queues: dict[int, StreamQueue] = {}
        self.connections: set[_Connection] = set()
        self._next_key = 0
        self.refused = 0                        # frames refused by the strict decoder
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

    def deliver(self, records: tuple[StepRecord, ...]) -> None:
        queues = self.queues
        for rec in records:
            q = queues.get(rec.key)
            if q is not None:       # unknown: an attempt already given up (e.g. after a failover)
                q.push(rec.delta(q.request_id))

    def fail(self, errors: tuple[StreamError, ...]) -> None:
        for e in errors:
            q = self.queues.get(e.key)
            if q is not None:
                q.push(StreamBroken(e.message))

    def stats(self, worker: str, body: dict) -> bool:
        """A stats frame: handed to `on_stats`; False (refused, drop the peer) when it refuses it."""
        if self.on_stats is None:
            return True
        try:
            self.on_stats(worker, body)
        except ValueError as exc:
            self.refuse(worker, FrameError(f"stats: {exc}"))
            return False
        return True

    def refuse(self, worker: str | None, exc: FrameError) -> None:
        """A frame refused (undecodable, over the size limit, or a failed hello): counted, and the
        streams it was for fail now (the worker's fault: the router continues them elsewhere)
        instead of waiting for a delta that never comes. The caller drops the connection."""
        self.refused += 1
        log.warning("token stream: refused a frame from %s: %s", worker or "an unknown peer", exc)
        if worker is not None:
            self.fail(tuple(StreamError(k, f"worker {worker} sent a malformed token frame: {exc}") for k in exc.keys))

    async def stop(self) -> None:
        """Stop listening and drop every worker's connection (their streams to us then fail)."""
        if self.server is not None:
            self.server.close()
            for conn in list(self.connections):
                conn.transport.abort()
            await self.server.wait_closed()
