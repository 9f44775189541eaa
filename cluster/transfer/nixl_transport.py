"""NIXL transport (UCX backend): the arena is registered once; a transfer is one prepped request
over per-(layer, k/v, block) descriptors, so any set of non-contiguous blocks moves in one post.
On GPU nodes the same code moves VRAM over RDMA/NVLink; on CPU hosts UCX moves DRAM between
processes (cma). The agent runs without NIXL's progress thread (see `__init__`). Agent metadata crosses as bytes inside our msgpack handshake; NIXL's own
pickle-based descriptor serialisation is never used.

The agent runs in NIXL's unsynchronised mode, so every call into it holds this transport's lock:
a worker's engine thread (posting a read, adding a peer) and its KV progress thread (polling,
notifying) share one agent.
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from cluster.config import apply_ucx_defaults
from cluster.transfer.base import (PROTOCOL_VERSION, ArenaGeometry, PeerMetadata, TransferError,
                                   TransferStatus, TransportUnavailable, check_compatible)
from cluster.types import KVLayout

log = logging.getLogger(__name__)


def _import_nixl():
    apply_ucx_defaults(torch.cuda.is_available)
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415
    except ImportError as exc:
        raise TransportUnavailable(
            f"the 'nixl' transport needs NIXL: pip install 'splitserve[nixl]' ({exc})") from exc
    return nixl_agent, nixl_agent_config


def _serialized(method):
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


@dataclass
class NixlTransfer:
    handle: object | None
    failed: bool = False


@dataclass
class _Peer:
    meta: PeerMetadata
    geometry: ArenaGeometry
    dlist: object


class NixlTransport:
    name = "nixl"
    refused = 0    # it makes no connections of its own to refuse (Transport.refused)

    def __init__(self, agent_name: str, backends: tuple[str, ...] = ("UCX",), progress_thread: bool = False):
        nixl_agent, nixl_agent_config = _import_nixl()
        self.agent_name = agent_name
        self._lock = threading.RLock()
        # No progress thread: NIXL's default one busy-polls a core per agent, forever. Our polls
        # of transfer states and notifications drive UCX progress instead, and only while a
        # handoff is in flight (see PollBackoff): the producer polls while a lease is live, which
        # serves a first connection's wire-up and reads UCX emulates over tcp; RDMA and cma reads
        # need no progress on the target. `progress_thread=True` is for benchmarks only.
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=progress_thread,
                                                              backends=list(backends)))
        self.peers: dict[str, _Peer] = {}
        self.arena: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        self._reg = None
        self._local = None

    def _mem_type(self) -> str:
        return "VRAM" if self.arena.is_cuda else "DRAM"

    def _device_id(self) -> int:
        """The arena's GPU ordinal as this process numbers it (NIXL's descriptor device id)."""
        if not self.arena.is_cuda:
            return 0
        return self.arena.device.index if self.arena.device.index is not None else torch.cuda.current_device()

    def _descs(self, base: int, geo: ArenaGeometry, device_id: int) -> np.ndarray:
        n = geo.num_layers * 2 * geo.num_blocks
        arr = np.empty((n, 3), dtype=np.int64)
        arr[:, 0] = base + np.arange(n, dtype=np.int64) * geo.segment_bytes
        arr[:, 1] = geo.segment_bytes
        arr[:, 2] = device_id
        return arr

    @_serialized
    def register(self, arena: torch.Tensor, layout: KVLayout) -> None:
        self.arena, self.layout = arena, layout
        self.geometry = ArenaGeometry.of(arena)
        self._reg = self.agent.register_memory([arena])
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                                 self._descs(arena.data_ptr(), self.geometry, self._device_id()),
                                                 self._mem_type())

    @_serialized
    def metadata(self) -> bytes:
        return PeerMetadata(self.agent_name, self.name, PROTOCOL_VERSION, self.layout, self.geometry.num_blocks,
                            self.arena.data_ptr(), self.agent.get_agent_metadata(), memory=self._mem_type(),
                            device_id=self._device_id()).encode()

    @_serialized
    def add_peer(self, metadata: bytes) -> str:
        peer = PeerMetadata.decode(metadata)
        check_compatible(self.layout, self.name, peer)
        if peer.name in self.peers:
            self.remove_peer(peer.name)
        name = self.agent.add_remote_agent(peer.payload)
        name = name.decode() if isinstance(name, bytes) else name
        geo = ArenaGeometry(self.geometry.num_layers, peer.num_blocks, self.geometry.segment_bytes)
        # The peer's blocks in the peer's memory, on the peer's device: a DRAM decode worker can read
        # a VRAM producer (and the reverse) where the backend supports it.
        dlist = self.agent.prep_xfer_dlist(name, self._descs(peer.base_address, geo, peer.device_id), peer.memory)
        self.peers[name] = _Peer(peer, geo, dlist)
        return name

    @_serialized
    def remove_peer(self, name: str) -> None:
        peer = self.peers.pop(name, None)
        if peer is None:
            return
        try:
            self.agent.release_dlist_handle(peer.dlist)
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - a dead peer may already be gone in UCX
            log.warning("removing NIXL peer %s: %s", name, exc)

    @_serialized
    def _post(self, op: str, peer_name: str, local_blocks, remote_blocks, layers) -> NixlTransfer:
        peer = self.peers.get(peer_name)
        if peer is None:
            raise TransferError(f"unknown peer {peer_name!r}: add its metadata first")
        local_idx = np.asarray(self.geometry.segment_indices(local_blocks, layers), dtype=np.int32)
        remote_idx = np.asarray(peer.geometry.segment_indices(remote_blocks, layers), dtype=np.int32)
        try:
            handle = self.agent.make_prepped_xfer(op, self._local, local_idx, peer.dlist, remote_idx)
            state = self.agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            log.warning("NIXL %s to %s failed to post: %s", op, peer_name, exc)
            return NixlTransfer(None, failed=True)
        return NixlTransfer(handle, failed=state == "ERR")

    def read(self, peer, remote_blocks, local_blocks, layers=None) -> NixlTransfer:
        return self._post("READ", peer, local_blocks, remote_blocks, layers)

    def write(self, peer, local_blocks, remote_blocks, layers=None) -> NixlTransfer:
        return self._post("WRITE", peer, local_blocks, remote_blocks, layers)

    @_serialized
    def poll(self, transfer: NixlTransfer) -> TransferStatus:
        if transfer.failed or transfer.handle is None:
            return TransferStatus.FAILED
        try:
            state = self.agent.check_xfer_state(transfer.handle)
        except Exception:  # noqa: BLE001
            state = "ERR"
        if state == "ERR":
            transfer.failed = True
            return TransferStatus.FAILED
        return TransferStatus.DONE if state == "DONE" else TransferStatus.PENDING

    @_serialized
    def release(self, transfer: NixlTransfer) -> None:
        if transfer.handle is not None:
            try:
                self.agent.release_xfer_handle(transfer.handle)
            except Exception as exc:  # noqa: BLE001 - releasing a transfer still in flight may fail
                log.warning("releasing NIXL transfer: %s", exc)
            transfer.handle = None

    @_serialized
    def notify(self, peer: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer, bytes(message))
        except Exception as exc:  # noqa: BLE001
            log.warning("NIXL notification to %s failed: %s", peer, exc)

    @_serialized
    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        for peer, messages in self.agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else peer
            out.extend((name, bytes(m)) for m in messages)
        return out

    @_serialized
    def close(self) -> None:
        for name in list(self.peers):
            self.remove_peer(name)
        if self._local is not None:
            self.agent.release_dlist_handle(self._local)
            self._local = None
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
