"""CUDA IPC transport: KV blocks copied GPU to GPU between processes of one node, no host hop.

For two workers that share a node (or a GPU) and where NIXL/UCX are not installed. Each agent
exports its KV arena's CUDA allocation as an IPC handle in its handshake; a peer opens it once and
then reads or writes blocks with device copies on its own CUDA stream (NVLink or PCIe peer-to-peer
between two GPUs, a device memcpy on one), completion polled through a CUDA event. Control
messages (notify) go over the TCP transport's authenticated socket; its segment ops are refused
here, since the bytes never cross it. The handle is plain bytes and integers in msgpack: nothing
is unpickled. Both processes must see both GPUs (CUDA_VISIBLE_DEVICES): a process cannot open
another's memory on a GPU it cannot see, so between Ray actors holding one GPU each only workers
that share a GPU (fractional --worker-gpus) can use it; NIXL is the path across a node's GPUs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.transfer.base import ArenaGeometry, TransferError, TransferStatus
from cluster.transfer.tcp import TcpTransport, _send
from cluster.types import KVLayout

log = logging.getLogger(__name__)


@dataclass
class CudaTransfer:
    event: torch.cuda.Event | None
    failed: bool = False


def _ipc_fields(storage: torch.UntypedStorage) -> dict:
    """The arena's allocation as msgpack-able IPC fields (torch's own CUDA storage sharing)."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return {"ipc": [int(device), bytes(handle), int(size), int(offset), bytes(ref_handle), int(ref_offset),
                    bytes(event_handle), bool(event_sync)]}


def _open_ipc(fields: list, offset: int, num_segments: int, segment_bytes: int) -> torch.Tensor:
    """The peer's arena as [segments, segment bytes] of device memory mapped into this process."""
    if not (isinstance(fields, list) and len(fields) == 8):
        raise TransferError("malformed CUDA IPC handle")
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    if offset < 0 or offset + num_segments * segment_bytes > flat.numel():
        raise TransferError("the peer's CUDA IPC handle is smaller than its arena")
    return flat[offset:offset + num_segments * segment_bytes].view(num_segments, segment_bytes)


class CudaIpcTransport(TcpTransport):
    name = "cuda_ipc"

    def __init__(self, agent_name: str, **options):
        super().__init__(agent_name, **options)
        self._stream: torch.cuda.Stream | None = None
        self._remote: dict[str, torch.Tensor] = {}

    def register(self, arena: torch.Tensor, layout: KVLayout) -> None:
        if not arena.is_cuda:
            raise TransferError("the cuda_ipc transport moves device memory; use nixl or tcp for a host arena")
        self.arena, self.layout = arena, layout
        self.geometry = ArenaGeometry.of(arena)
        self._segments = arena.view(torch.uint8).view(-1, self.geometry.segment_bytes)
        self._stream = torch.cuda.Stream(device=arena.device)

    def _payload(self) -> dict:
        storage = self.arena.untyped_storage()
        offset = self.arena.data_ptr() - storage.data_ptr()
        return {**super()._payload(), **_ipc_fields(storage), "offset": int(offset)}

    def add_peer(self, metadata: bytes) -> str:
        name = super().add_peer(metadata)
        peer = self.peers[name]
        try:
            segments = self.geometry.num_layers * 2 * peer["meta"].num_blocks
            self._remote[name] = _open_ipc(peer.get("ipc"), int(peer.get("offset", 0)), segments,
                                           self.geometry.segment_bytes)
        except (RuntimeError, TypeError, ValueError) as exc:
            self.peers.pop(name, None)
            raise TransferError(f"cannot open {name}'s KV arena over CUDA IPC (does this process see its GPU?): "
                                f"{exc}") from exc
        return name

    def remove_peer(self, name: str) -> None:
        super().remove_peer(name)
        self._remote.pop(name, None)

    def _copy(self, peer: str, remote_blocks, local_blocks, layers, into_local: bool) -> CudaTransfer:
        remote = self._remote.get(peer)
        if remote is None:
            raise TransferError(f"unknown peer {peer!r}: add its metadata first")
        remote_ids, local_ids = self._plan(peer, remote_blocks, local_blocks, layers)
        dev = self.arena.device
        self._stream.wait_stream(torch.cuda.current_stream(dev))   # the KV the engine just wrote
        with torch.cuda.stream(self._stream):
            # The index tensors are allocated on the side stream that reads them: made on the
            # current stream, they would be freed when this returns and handed out again there
            # before the copy ran (other blocks moved, silently, unless checksums are on).
            remote_idx = torch.tensor(remote_ids, dtype=torch.long).to(dev, non_blocking=True)
            local_idx = local_ids.to(dev, non_blocking=True)
            if into_local:
                self._segments.index_copy_(0, local_idx, remote.index_select(0, remote_idx))
            else:
                remote.index_copy_(0, remote_idx, self._segments.index_select(0, local_idx))
            event = torch.cuda.Event()
            event.record(self._stream)
        return CudaTransfer(event)

    def read(self, peer, remote_blocks, local_blocks, layers=None) -> CudaTransfer:
        return self._copy(peer, list(remote_blocks), list(local_blocks), layers, into_local=True)

    def write(self, peer, local_blocks, remote_blocks, layers=None) -> CudaTransfer:
        return self._copy(peer, list(remote_blocks), list(local_blocks), layers, into_local=False)

    def poll(self, transfer: CudaTransfer) -> TransferStatus:
        if transfer.failed or transfer.event is None:
            return TransferStatus.FAILED
        return TransferStatus.DONE if transfer.event.query() else TransferStatus.PENDING

    def release(self, transfer: CudaTransfer) -> None:
        transfer.event = None

    def _serve_request(self, conn, peer: str, header: dict) -> None:
        if header.get("op") == "notify":
            super()._serve_request(conn, peer, header)
        else:   # the bytes move over CUDA IPC; the socket carries control messages only
            _send(conn, {"ok": False, "error": "the cuda_ipc transport serves no segments over its socket"})
