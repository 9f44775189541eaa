"""Plain TCP transport, for machines with neither NIXL nor UCX (a laptop, a CI box).

Each agent serves its registered arena on an explicit address. A request is a length-prefixed
msgpack header, optionally followed by raw bytes; a peer must present the serving agent's token
(learnt from its handshake metadata, compared with hmac.compare_digest) before anything else.
Transfers run on a small thread pool so that `poll` never blocks; every socket has a timeout, so a
dead peer turns into FAILED, never a hang.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import msgpack
import torch

from cluster.transfer.base import TransferError
from cluster.transfer.host_segments import FutureTransfer, HostSegmentTransport

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_MAX_HEADER = 16 << 20


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
                 workers: int = 2):
        super().__init__(agent_name)
        self.timeout_s = timeout_s
        self.token = secrets.token_hex(16)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"tcp-{agent_name}")
        self._server = socket.create_server((host, port))
        self._server.settimeout(0.5)
        self.address = self._server.getsockname()[:2]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"tcp-serve-{agent_name}", daemon=True)
        self._thread.start()

    def _payload(self) -> dict:
        return {"host": self.address[0], "port": self.address[1], "token": self.token}

    # --- client side -------------------------------------------------------------------------
    def _connect(self, peer_name: str) -> socket.socket:
        peer = self._peer(peer_name)
        sock = socket.create_connection((str(peer["host"]), int(peer["port"])), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # small request/reply frames: no Nagle wait
        _send(sock, {"op": "hello", "name": self.agent_name, "token": str(peer["token"])})
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
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                hello = _recv_header(conn)
                token = str(hello.get("token", ""))
                if hello.get("op") != "hello" or not hmac.compare_digest(token.encode(), self.token.encode()):
                    _send(conn, {"ok": False, "error": "bad token"})
                    return
                _send(conn, {"ok": True})
                self._serve_request(conn, str(hello.get("name", "?")), _recv_header(conn))
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
        self._server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=2)
