"""In-process transport for unit tests of the handoff policy: agents in one process, copies by torch.
The inbox is locked: a worker's engine thread and its KV progress thread both use it."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from cluster.transfer.base import (PROTOCOL_VERSION, PeerMetadata, TransferError,
                                   TransferStatus, check_compatible)
from cluster.types import KVLayout

_AGENTS: dict[str, "LoopbackTransport"] = {}


@dataclass
class LoopbackTransfer:
    status: TransferStatus


class LoopbackTransport:
    name = "loopback"
    refused = 0    # it makes no connections of its own to refuse (Transport.refused)

    def __init__(self, agent_name: str):
        if agent_name in _AGENTS:
            raise TransferError(f"agent name {agent_name!r} is taken")
        self.agent_name = agent_name
        self.arena: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        self.peers: set[str] = set()
        self.inbox: list[tuple[str, bytes]] = []
        self._inbox_lock = threading.Lock()
        self.fail_next = False          # tests: make the next transfer fail
        _AGENTS[agent_name] = self

    def register(self, arena: torch.Tensor, layout: KVLayout) -> None:
        self.arena, self.layout = arena, layout

    def metadata(self) -> bytes:
        return PeerMetadata(self.agent_name, self.name, PROTOCOL_VERSION, self.layout, self.arena.shape[2],
                            0, b"").encode()

    def add_peer(self, metadata: bytes) -> str:
        peer = PeerMetadata.decode(metadata)
        check_compatible(self.layout, self.name, peer)
        self.peers.add(peer.name)
        return peer.name

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)

    def _peer(self, name: str) -> "LoopbackTransport":
        other = _AGENTS.get(name)
        if name not in self.peers or other is None:
            raise TransferError(f"unknown or departed peer {name!r}")
        return other

    def _copy(self, src: torch.Tensor, src_blocks, dst: torch.Tensor, dst_blocks, layers) -> LoopbackTransfer:
        if self.fail_next:
            self.fail_next = False
            return LoopbackTransfer(TransferStatus.FAILED)
        s = torch.tensor(list(src_blocks), dtype=torch.long)
        d = torch.tensor(list(dst_blocks), dtype=torch.long)
        layer_ids = range(src.shape[0]) if layers is None else layers
        for l in layer_ids:
            dst[l].index_copy_(1, d, src[l].index_select(1, s))
        return LoopbackTransfer(TransferStatus.DONE)

    def read(self, peer, remote_blocks, local_blocks, layers=None) -> LoopbackTransfer:
        try:
            other = self._peer(peer)
        except TransferError:
            return LoopbackTransfer(TransferStatus.FAILED)
        return self._copy(other.arena, remote_blocks, self.arena, local_blocks, layers)

    def write(self, peer, local_blocks, remote_blocks, layers=None) -> LoopbackTransfer:
        try:
            other = self._peer(peer)
        except TransferError:
            return LoopbackTransfer(TransferStatus.FAILED)
        return self._copy(self.arena, local_blocks, other.arena, remote_blocks, layers)

    def poll(self, transfer: LoopbackTransfer) -> TransferStatus:
        return transfer.status

    def release(self, transfer: LoopbackTransfer) -> None:
        pass

    def notify(self, peer: str, message: bytes) -> None:
        other = _AGENTS.get(peer)
        if other is not None:
            with other._inbox_lock:
                other.inbox.append((self.agent_name, bytes(message)))

    def notifications(self) -> list[tuple[str, bytes]]:
        with self._inbox_lock:
            out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        _AGENTS.pop(self.agent_name, None)
