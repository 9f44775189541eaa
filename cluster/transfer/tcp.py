"""Plain TCP transport, for machines with neither NIXL nor UCX (a laptop, a CI box).

Each agent serves its registered arena on an explicit address (the node's, from configuration).
A request is a length-prefixed msgpack header, optionally followed by raw bytes. A connection's
first frame is its hello: sealed with the cluster secret (cluster/transfer/auth.py: an HMAC with a
nonce, naming the agent it is for) or, without a secret (single-process tests), the serving
agent's token. The accept thread reads hellos itself, non-blocking, at most `MAX_HELLO` bytes and
`HELLO_TIMEOUT_S` seconds each, `MAX_PENDING` at a time: a connection that fails its hello costs
no thread and no buffer beyond that, and only an authenticated one is handed to the bounded pool
of handler threads. Transfers run on a small client pool so that `poll` never blocks; every socket
has a timeout, so a dead peer turns into FAILED, never a hang.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import torch

from cluster.transfer.base import TransferError
from cluster.transfer.host_segments import FutureTransfer, HostSegmentTransport

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_MAX_HEADER = 16 << 20
MAX_HELLO = 4096
HELLO_TIMEOUT_S = 5.0
MAX_PENDING = 64           # connections still in their hello
_HELLO = b"tcp-hello"


def _send(sock: socket.socket, header: dict, payload=None) -> None:
    data = msgpack.packb(header)
    sock.sendall(_HEADER.pack(len(data)) + data)
    if payload is not None:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def _recv_header(sock: socket.socket) -> dict:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > _MAX_HEADER:
        raise ConnectionError(f"header of {n} bytes refused")
    header = msgpack.unpackb(bytes(_recv_exact(sock, n)))
    if not isinstance(header, dict):
        raise ConnectionError("malformed header")
    return header


class TcpTransport(HostSegmentTransport):
    name = "tcp"

    def __init__(self, agent_name: str, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 workers: int = 2, sealer=None, handlers: int = 8, hello_timeout_s: float = HELLO_TIMEOUT_S):
        super().__init__(agent_name)
        self.timeout_s = timeout_s
        self.sealer = sealer
        self.hello_timeout_s = hello_timeout_s
        self.token = secrets.token_hex(16)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"tcp-{agent_name}")
        self._handlers = ThreadPoolExecutor(max_workers=handlers, thread_name_prefix=f"tcp-serve-{agent_name}")
        self.refused = 0           # connections that failed their hello
        self._server = socket.create_server((host, port))
        self._server.setblocking(False)
        self.address = self._server.getsockname()[:2]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"tcp-serve-{agent_name}", daemon=True)
        self._thread.start()

    def _payload(self) -> dict:
        # With a cluster secret the token is not what admits a peer (the sealed hello is).
        return {"host": self.address[0], "port": self.address[1], "token": "" if self.sealer else self.token}

    # --- client side -------------------------------------------------------------------------
    def _connect(self, peer_name: str) -> socket.socket:
        peer = self._peer(peer_name)
        sock = socket.create_connection((str(peer["host"]), int(peer["port"])), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # small request/reply frames: no Nagle wait
        hello = {"op": "hello", "name": self.agent_name, "to": peer_name, "token": str(peer["token"])}
        if self.sealer is not None:
            body = self.sealer.seal(_HELLO, msgpack.packb(hello))
            sock.sendall(_HEADER.pack(len(body)) + body)
        else:
            _send(sock, hello)
        if not _recv_header(sock).get("ok"):
            sock.close()
            raise TransferError(f"peer {peer_name!r} refused the connection")
        return sock

    def _do_read(self, peer: str, remote_blocks, local_blocks, layers) -> None:
        remote, local = self._plan(peer, remote_blocks, local_blocks, layers)
        with self._connect(peer) as sock:
            _send(sock, {"op": "read", "segments": remote})
            reply = _recv_header(sock)
            if not reply.get("ok"):
                raise TransferError(f"read refused: {reply.get('error')}")
            buf = torch.empty((len(local), self.geometry.segment_bytes), dtype=torch.uint8)
            _recv_exact(sock, buf.numel(), memoryview(buf.numpy()).cast("B"))
        self._segments.index_copy_(0, local, buf)

    def _do_write(self, peer: str, local_blocks, remote_blocks, layers) -> None:
        remote, local = self._plan(peer, remote_blocks, local_blocks, layers)
        data = self._segments.index_select(0, local)
        with self._connect(peer) as sock:
            _send(sock, {"op": "write", "segments": remote}, memoryview(data.numpy()).cast("B"))
            reply = _recv_header(sock)
            if not reply.get("ok"):
                raise TransferError(f"write refused: {reply.get('error')}")

    def read(self, peer, remote_blocks, local_blocks, layers=None) -> FutureTransfer:
        return FutureTransfer(self._pool.submit(self._do_read, peer, list(remote_blocks), list(local_blocks), layers))

    def write(self, peer, local_blocks, remote_blocks, layers=None) -> FutureTransfer:
        return FutureTransfer(self._pool.submit(self._do_write, peer, list(local_blocks), list(remote_blocks), layers))

    def notify(self, peer: str, message: bytes) -> None:
        try:
            with self._connect(peer) as sock:
                _send(sock, {"op": "notify", "msg": bytes(message)})
                _recv_header(sock)
        except (OSError, TransferError) as exc:
            log.warning("tcp notification to %s failed: %s", peer, exc)

    # --- server side -------------------------------------------------------------------------
    def _serve(self) -> None:
        """Accept and read hellos on this one thread; hand authenticated connections to the pool."""
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        pending: dict[socket.socket, tuple[float, bytearray]] = {}
        while not self._closed.is_set():
            try:
                events = sel.select(timeout=0.5)
            except (OSError, ValueError):
                break
            for key, _ in events:
                if key.fileobj is self._server:
                    self._accept(sel, pending)
                else:
                    self._read_hello(sel, pending, key.fileobj)
            now = time.monotonic()
            for conn in [c for c, (deadline, _) in pending.items() if deadline < now]:
                self._drop(sel, pending, conn)
        for conn in list(pending):
            self._drop(sel, pending, conn)
        sel.close()

    def _accept(self, sel, pending: dict) -> None:
        try:
            conn, _ = self._server.accept()
        except OSError:
            return
        if len(pending) >= MAX_PENDING:
            self.refused += 1
            conn.close()
            return
        conn.setblocking(False)
        pending[conn] = (time.monotonic() + self.hello_timeout_s, bytearray())
        sel.register(conn, selectors.EVENT_READ)

    def _drop(self, sel, pending: dict, conn: socket.socket, refused: bool = True) -> None:
        pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        if refused:
            self.refused += 1
            conn.close()

    def _read_hello(self, sel, pending: dict, conn: socket.socket) -> None:
        _, buf = pending[conn]
        try:
            data = conn.recv(_HEADER.size + MAX_HELLO - len(buf))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, pending, conn)
            return
        buf += data
        if len(buf) < _HEADER.size:
            return
        (n,) = _HEADER.unpack_from(buf)
        if n > MAX_HELLO:
            self._drop(sel, pending, conn)
            return
        if len(buf) < _HEADER.size + n:
            return
        peer = self._check_hello(bytes(buf[_HEADER.size:_HEADER.size + n]))
        if peer is None or len(buf) != _HEADER.size + n:
            self._drop(sel, pending, conn)
            return
        self._drop(sel, pending, conn, refused=False)
        conn.setblocking(True)
        self._handlers.submit(self._handle, conn, peer)

    def _check_hello(self, frame: bytes) -> str | None:
        """The authenticated peer's name, or None."""
        if self.sealer is not None:
            frame = self.sealer.open(_HELLO, frame, MAX_HELLO)
            if frame is None:
                return None
        try:
            hello = msgpack.unpackb(frame, max_str_len=256, max_bin_len=0, max_array_len=0, max_map_len=8)
        except Exception:  # noqa: BLE001 - garbage
            return None
        if not isinstance(hello, dict) or hello.get("op") != "hello" or not isinstance(hello.get("name"), str):
            return None
        if self.sealer is not None:
            return hello["name"] if hello.get("to") == self.agent_name else None
        token = hello.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self.token.encode()):
            return None
        return hello["name"]

    def _handle(self, conn: socket.socket, peer: str) -> None:
        conn.settimeout(self.timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                _send(conn, {"ok": True})
                self._serve_request(conn, peer, _recv_header(conn))
            except (OSError, ConnectionError, ValueError, msgpack.UnpackException) as exc:
                log.debug("tcp connection dropped: %s", exc)

    def _serve_request(self, conn: socket.socket, peer: str, header: dict) -> None:
        op = header.get("op")
        if op == "notify":
            self._deliver(peer, bytes(header.get("msg", b"")))
            _send(conn, {"ok": True})
        elif op == "read":
            idx = self._checked_segments(header)
            if idx is None:
                _send(conn, {"ok": False, "error": "bad segment list"})
                return
            data = self._segments.index_select(0, idx)
            _send(conn, {"ok": True}, memoryview(data.numpy()).cast("B"))
        elif op == "write":
            idx = self._checked_segments(header)
            if idx is None:
                _send(conn, {"ok": False, "error": "bad segment list"})
                return
            buf = torch.empty((len(idx), self.geometry.segment_bytes), dtype=torch.uint8)
            _recv_exact(conn, buf.numel(), memoryview(buf.numpy()).cast("B"))
            self._segments.index_copy_(0, idx, buf)
            _send(conn, {"ok": True})
        else:
            _send(conn, {"ok": False, "error": f"unknown op {op!r}"})

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._handlers.shutdown(wait=False, cancel_futures=True)
