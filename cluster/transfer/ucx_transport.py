"""UCX transport through ucxx (the maintained successor of ucx-py), for sites that run UCX
without NIXL. Peers connect by UCX worker address (exchanged in our msgpack handshake), so no
listening socket is opened; UCX's own interfaces follow UCX_NET_DEVICES (loopback here).

ucxx is two-sided (tag send/recv), so a transfer is a small RPC: the requester sends a msgpack
header on the request tag; the serving agent answers on a tag unique to that request, with the
segments' bytes for a read. Everything runs on one asyncio loop thread; public methods return at
once and `poll` checks the future. ucxx keeps one context per process, hence one agent per process.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
import threading
from concurrent.futures import Future

import msgpack
import numpy as np
import torch

from cluster.config import apply_ucx_defaults
from cluster.transfer.base import TransferError, TransportUnavailable
from cluster.transfer.host_segments import FutureTransfer, HostSegmentTransport

log = logging.getLogger(__name__)

_REQUEST_TAG = 0x5350_4C49_5400_0001
MAX_REQUEST_BYTES = 16 << 20     # a request header (its segment list); payloads are sized by us
_SEAL = b"ucx-request"
_IN_PROCESS: list[str] = []


class UcxTransport(HostSegmentTransport):
    name = "ucx"

    def __init__(self, agent_name: str, timeout_s: float = 30.0, sealer=None, host: str | None = None):
        """`sealer`: the cluster secret's (cluster/transfer/auth.py): request headers are sealed and
        verified before anything is received for them. (UCX picks its own interfaces: `host` is
        unused, UCX_NET_DEVICES says which.)"""
        if _IN_PROCESS:
            raise TransferError(f"ucxx allows one agent per process ({_IN_PROCESS[0]} exists)")
        apply_ucx_defaults(torch.cuda.is_available)
        try:
            import ucxx  # noqa: PLC0415
        except ImportError as exc:
            raise TransportUnavailable(f"the 'ucx' transport needs ucxx: pip install ucxx-cu12 ({exc})") from exc
        super().__init__(agent_name)
        self.ucxx = ucxx
        self.timeout_s = timeout_s
        self.sealer = sealer
        self.token = secrets.token_hex(16)
        self._endpoints: dict[str, object] = {}
        self._tags = itertools.count(secrets.randbits(40) << 16)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"ucx-{agent_name}", daemon=True)
        self._thread.start()
        self._address = self._run(self._start()).result(timeout=30)
        _IN_PROCESS.append(agent_name)

    def _run(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _start(self) -> bytes:
        self.ucxx.init()
        self._serving = asyncio.ensure_future(self._serve())
        return bytes(self.ucxx.get_worker_address().tobytes())

    def _payload(self) -> dict:
        return {"address": self._address, "token": self.token}

    def add_peer(self, metadata: bytes) -> str:
        name = super().add_peer(metadata)
        self._endpoints.pop(name, None)
        return name

    def remove_peer(self, name: str) -> None:
        super().remove_peer(name)
        ep = self._endpoints.pop(name, None)
        if ep is not None:
            ep.abort()

    # --- requester side ----------------------------------------------------------------------
    async def _endpoint(self, peer: str):
        ep = self._endpoints.get(peer)
        if ep is None or ep.closed:
            address = self.ucxx.get_ucx_address_from_buffer(bytes(self._peer(peer)["address"]))
            ep = await self.ucxx.create_endpoint_from_worker_address(address)
            self._endpoints[peer] = ep
        return ep

    async def _recv_tagged(self, tag: int, max_bytes: int = MAX_REQUEST_BYTES) -> bytes:
        """The next message on `tag`; one announcing more than `max_bytes` is refused unread (no
        buffer is allocated for what a sender merely announces)."""
        ctx = self.ucxx.core._get_ctx()
        while True:
            probe = ctx.tag_probe(tag, remove=True)
            if probe.matched and probe.length > max_bytes:
                raise TransferError(f"a {probe.length}-byte message on tag {tag:#x} refused (limit {max_bytes})")
            if probe.matched:
                buf = np.empty(probe.length, dtype=np.uint8)
                await ctx.recv_with_handle(buf, probe)
                return buf.tobytes()
            await asyncio.sleep(0.0002)

    async def _request(self, peer: str, header: dict, payload=None, reply_bytes: int = 0):
        ep = await self._endpoint(peer)
        tag = next(self._tags) << 2
        header = {**header, "from": self.agent_name, "to": peer, "token": self.peers[peer]["token"], "tag": tag}
        data = msgpack.packb(header)
        if self.sealer is not None:
            data = self.sealer.seal(_SEAL, data)
        await ep.send(np.frombuffer(data, dtype=np.uint8), tag=_REQUEST_TAG, force_tag=True)
        if payload is not None:
            await ep.send(payload, tag=tag + 1, force_tag=True)
        reply = msgpack.unpackb(await self._recv_tagged(tag))
        if not reply.get("ok"):
            raise TransferError(f"{header['op']} refused by {peer}: {reply.get('error')}")
        if reply_bytes:
            buf = torch.empty(reply_bytes, dtype=torch.uint8)
            await self.ucxx.core._get_ctx().recv(buf.numpy(), tag + 2)
            return buf
        return None

    def _submit(self, coro) -> FutureTransfer:
        return FutureTransfer(self._run(asyncio.wait_for(coro, self.timeout_s)))

    def read(self, peer, remote_blocks, local_blocks, layers=None) -> FutureTransfer:
        remote, local = self._plan(peer, remote_blocks, local_blocks, layers)

        async def go():
            buf = await self._request(peer, {"op": "read", "segments": remote},
                                      reply_bytes=len(remote) * self.geometry.segment_bytes)
            self._segments.index_copy_(0, local, buf.view(len(remote), -1))
        return self._submit(go())

    def write(self, peer, local_blocks, remote_blocks, layers=None) -> FutureTransfer:
        remote, local = self._plan(peer, remote_blocks, local_blocks, layers)
        data = self._segments.index_select(0, local).view(-1).numpy()
        return self._submit(self._request(peer, {"op": "write", "segments": remote}, payload=data))

    def notify(self, peer: str, message: bytes) -> None:
        try:
            self._run(asyncio.wait_for(self._request(peer, {"op": "notify", "msg": bytes(message)}),
                                       self.timeout_s)).result(self.timeout_s + 1)
        except Exception as exc:  # noqa: BLE001 - a dead peer: the handoff's own timeouts take over
            log.warning("ucx notification to %s failed: %s", peer, exc)

    # --- serving side --------------------------------------------------------------------------
    async def _serve(self) -> None:
        while True:
            try:
                data = await self._recv_tagged(_REQUEST_TAG)
                if self.sealer is not None:
                    data = self.sealer.open(_SEAL, data, MAX_REQUEST_BYTES)
                    if data is None:
                        log.warning("ucx: refused a request not sealed with the cluster secret")
                        continue
                header = msgpack.unpackb(data)
                if isinstance(header, dict) and (self.sealer is None or header.get("to") == self.agent_name):
                    asyncio.ensure_future(self._handle(header))
            except asyncio.CancelledError:
                return
            except Exception as exc:  # noqa: BLE001 - a malformed request must not stop serving
                log.warning("ucx: bad request: %s", exc)

    async def _reply(self, peer: str, tag: int, header: dict, payload=None) -> None:
        ep = await self._endpoint(peer)
        await ep.send(np.frombuffer(msgpack.packb(header), dtype=np.uint8), tag=tag, force_tag=True)
        if payload is not None:
            await ep.send(payload, tag=tag + 2, force_tag=True)

    async def _handle(self, h: dict) -> None:
        peer, tag = str(h.get("from", "")), int(h.get("tag", 0))
        if peer not in self.peers or not hmac.compare_digest(str(h.get("token", "")).encode(), self.token.encode()):
            log.warning("ucx: refused a request from %r", peer)
            return   # unknown peers get no endpoint back
        try:
            op = h.get("op")
            if op == "notify":
                self._deliver(peer, bytes(h.get("msg", b"")))
                await self._reply(peer, tag, {"ok": True})
                return
            idx = self._checked_segments(h)
            if idx is None:
                await self._reply(peer, tag, {"ok": False, "error": "bad segment list"})
                return
            if op == "read":
                data = self._segments.index_select(0, idx).view(-1).numpy()
                await self._reply(peer, tag, {"ok": True}, payload=data)
            elif op == "write":
                buf = torch.empty((len(idx), self.geometry.segment_bytes), dtype=torch.uint8)
                await self.ucxx.core._get_ctx().recv(buf.view(-1).numpy(), tag + 1)
                self._segments.index_copy_(0, idx, buf)
                await self._reply(peer, tag, {"ok": True})
            else:
                await self._reply(peer, tag, {"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001
            log.warning("ucx: request from %s failed: %s", peer, exc)

    def close(self) -> None:
        async def stop():
            self._serving.cancel()
            for ep in self._endpoints.values():
                ep.abort()
        try:
            self._run(stop()).result(5)
        except Exception:  # noqa: BLE001
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        _IN_PROCESS.clear()
