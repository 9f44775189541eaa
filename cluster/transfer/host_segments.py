"""What the two-sided host-memory transports (TCP, UCX) share: the arena seen as rows of
segments, the handshake (a msgpack payload with the serving agent's address and token), the
server-side bounds check of a request's segment list, and the notification inbox."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import msgpack
import torch

from cluster.transfer.base import (PROTOCOL_VERSION, ArenaGeometry, PeerMetadata, TransferError,
                                   TransferStatus, check_compatible)
from cluster.types import KVLayout

log = logging.getLogger(__name__)


@dataclass
class FutureTransfer:
    """A transfer running on the transport's own thread or event loop."""

    future: Future


class HostSegmentTransport:
    name = "host"
    refused = 0    # it makes no connections of its own to refuse (Transport.refused)

    def __init__(self, agent_name: str):
        self.agent_name = agent_name
        self.peers: dict[str, dict] = {}
        self.arena: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        self._inbox: list[tuple[str, bytes]] = []
        self._inbox_lock = threading.Lock()

    def _payload(self) -> dict:
        """Transport-specific handshake fields (address, token)."""
        raise NotImplementedError

    def register(self, arena: torch.Tensor, layout: KVLayout) -> None:
        if arena.device.type != "cpu":
            raise TransferError(f"the {self.name} transport moves host memory; use nixl for device memory")
        self.arena, self.layout = arena, layout
        self.geometry = ArenaGeometry.of(arena)
        self._segments = arena.view(torch.uint8).view(-1, self.geometry.segment_bytes)

    def metadata(self) -> bytes:
        return PeerMetadata(self.agent_name, self.name, PROTOCOL_VERSION, self.layout, self.geometry.num_blocks,
                            0, msgpack.packb(self._payload())).encode()

    def add_peer(self, metadata: bytes) -> str:
        peer = PeerMetadata.decode(metadata)
        check_compatible(self.layout, self.name, peer)
        self.peers[peer.name] = {"meta": peer, **msgpack.unpackb(peer.payload)}
        return peer.name

    def remove_peer(self, name: str) -> None:
        self.peers.pop(name, None)

    def _peer(self, name: str) -> dict:
        peer = self.peers.get(name)
        if peer is None:
            raise TransferError(f"unknown peer {name!r}: add its metadata first")
        return peer

    def _segment_ids(self, blocks, layers, num_blocks: int) -> list[int]:
        geo = ArenaGeometry(self.geometry.num_layers, num_blocks, self.geometry.segment_bytes)
        return geo.segment_indices(blocks, layers)

    def _plan(self, peer: str, remote_blocks, local_blocks, layers) -> tuple[list[int], torch.Tensor]:
        """Remote segment ids (sent to the peer) and local ones (a tensor for gather/scatter)."""
        remote = self._segment_ids(remote_blocks, layers, self._peer(peer)["meta"].num_blocks)
        local = self._segment_ids(local_blocks, layers, self.geometry.num_blocks)
        return remote, torch.tensor(local, dtype=torch.long)

    def _checked_segments(self, header: dict) -> torch.Tensor | None:
        """A request's segment list, or None if it is malformed or out of bounds."""
        segs = header.get("segments")
        total = self._segments.shape[0] if self.arena is not None else 0
        if not isinstance(segs, list) or not all(isinstance(s, int) and 0 <= s < total for s in segs):
            return None
        return torch.tensor(segs, dtype=torch.long)

    def poll(self, transfer: FutureTransfer) -> TransferStatus:
        if not transfer.future.done():
            return TransferStatus.PENDING
        if transfer.future.cancelled() or transfer.future.exception() is not None:
            log.warning("%s transfer failed: %s", self.name,
                        "cancelled" if transfer.future.cancelled() else transfer.future.exception())
            return TransferStatus.FAILED
        return TransferStatus.DONE

    def release(self, transfer: FutureTransfer) -> None:
        transfer.future.cancel()

    def _deliver(self, peer: str, message: bytes) -> None:
        with self._inbox_lock:
            self._inbox.append((peer, message))

    def notifications(self) -> list[tuple[str, bytes]]:
        with self._inbox_lock:
            out, self._inbox = self._inbox, []
        return out
