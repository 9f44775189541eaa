"""The transport interface and what every transport shares: peer metadata, the handshake check,
and the addressing of KV segments inside the arena.

A KV block is not one contiguous range: the arena is [layers, 2 (k, v), blocks, block_size,
kv_heads, head_dim], so block b is 2 * layers segments of `segment_bytes` each, one per (layer,
k/v). A transfer of blocks B over layers Ls moves, in canonical order, for each b in B, for each
l in Ls, k then v. Every transport moves the same segments in the same order.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Protocol

import msgpack
import torch

from cluster.types import KVLayout

PROTOCOL_VERSION = 1


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferError(RuntimeError):
    pass


class LayoutMismatch(TransferError):
    """Two caches that cannot exchange blocks; the message names every differing field."""


class TransportUnavailable(TransferError):
    pass


@dataclass(frozen=True)
class PeerMetadata:
    """What one agent tells another at handshake (msgpack on the wire, never pickle)."""

    name: str
    transport: str
    protocol_version: int
    layout: KVLayout
    num_blocks: int
    base_address: int
    payload: bytes           # transport specific (NIXL agent metadata, a TCP address, ...)
    memory: str = "DRAM"     # where the peer's arena lives: "DRAM" (host) or "VRAM" (a GPU)
    device_id: int = 0       # the peer's GPU ordinal for VRAM (its own numbering)

    def __post_init__(self) -> None:
        if self.memory not in ("DRAM", "VRAM"):
            raise ValueError(f"peer memory must be DRAM or VRAM, got {self.memory!r}")

    def encode(self) -> bytes:
        return msgpack.packb({
            "name": self.name, "transport": self.transport, "protocol_version": self.protocol_version,
            "layout": {f.name: getattr(self.layout, f.name) for f in fields(KVLayout)},
            "num_blocks": self.num_blocks, "base_address": self.base_address, "payload": self.payload,
            "memory": self.memory, "device_id": self.device_id,
        })

    @classmethod
    def decode(cls, data: bytes) -> "PeerMetadata":
        """Strict: exact fields, types and ranges, bounded sizes; anything else is a TransferError."""
        try:
            raw = msgpack.unpackb(data, max_map_len=16, max_array_len=0, max_str_len=256, max_bin_len=1 << 20)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds on garbage
            raise TransferError(f"malformed peer metadata: {type(exc).__name__}") from None
        try:
            if not isinstance(raw, dict) or set(raw) != _PEER_FIELDS:
                raise ValueError("fields")
            layout = raw["layout"]
            if not isinstance(layout, dict) or set(layout) != {f.name for f in fields(KVLayout)}:
                raise ValueError("layout fields")
            types = {f.name: (str if f.type in ("str", str) else int) for f in fields(KVLayout)}
            if not all(isinstance(layout[k], t) and not isinstance(layout[k], bool) for k, t in types.items()):
                raise ValueError("layout types")
            ints = {"protocol_version": (0, 1 << 16), "num_blocks": (1, 1 << 31), "base_address": (0, 1 << 64),
                    "device_id": (0, 1 << 10)}
            for k, (low, high) in ints.items():
                v = raw[k]
                if not (isinstance(v, int) and not isinstance(v, bool) and low <= v < high):
                    raise ValueError(k)
            if not (isinstance(raw["name"], str) and raw["name"] and isinstance(raw["transport"], str)
                    and isinstance(raw["payload"], bytes) and isinstance(raw["memory"], str)):
                raise ValueError("types")
            return cls(name=raw["name"], transport=raw["transport"], protocol_version=raw["protocol_version"],
                       layout=KVLayout(**layout), num_blocks=raw["num_blocks"], base_address=raw["base_address"],
                       payload=raw["payload"], memory=raw["memory"], device_id=raw["device_id"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"malformed peer metadata: {exc}") from None


_PEER_FIELDS = {"name", "transport", "protocol_version", "layout", "num_blocks", "base_address", "payload",
                "memory", "device_id"}


def check_compatible(local: KVLayout, local_transport: str, peer: PeerMetadata) -> None:
    """Refuse a peer whose blocks would be misread. Names every field that differs."""
    problems = []
    if peer.protocol_version != PROTOCOL_VERSION:
        problems.append(f"protocol_version: local {PROTOCOL_VERSION}, peer {peer.protocol_version}")
    if peer.transport != local_transport:
        problems.append(f"transport: local {local_transport}, peer {peer.transport}")
    for f in fields(KVLayout):
        mine, theirs = getattr(local, f.name), getattr(peer.layout, f.name)
        if mine != theirs:
            problems.append(f"{f.name}: local {mine!r}, peer {theirs!r}")
    if problems:
        raise LayoutMismatch(f"peer {peer.name!r} has an incompatible KV layout: " + "; ".join(problems))


@dataclass(frozen=True)
class ArenaGeometry:
    num_layers: int
    num_blocks: int
    segment_bytes: int

    @classmethod
    def of(cls, arena: torch.Tensor) -> "ArenaGeometry":
        layers, two, blocks = arena.shape[:3]
        assert two == 2 and arena.is_contiguous()
        return cls(layers, blocks, arena[0, 0, 0].numel() * arena.element_size())

    def segment_index(self, layer: int, kv: int, block: int) -> int:
        return (layer * 2 + kv) * self.num_blocks + block

    def segment_indices(self, blocks, layers=None) -> list[int]:
        """Flat segment indices of `blocks` over `layers`, in canonical order."""
        layers = range(self.num_layers) if layers is None else layers
        nb = self.num_blocks
        return [(l * 2 + kv) * nb + b for b in blocks for l in layers for kv in (0, 1)]


class Transfer(Protocol):
    """A posted transfer; the transport's `poll` reports its status."""


class Transport(Protocol):
    name: str
    agent_name: str
    refused: int    # connections that failed their hello (a worker's stats); 0 where none are made

    def register(self, arena: torch.Tensor, layout: KVLayout) -> None:
        """Register the whole KV arena once; transfers then address blocks in it."""

    def metadata(self) -> bytes:
        """This agent's handshake bytes (a `PeerMetadata`)."""

    def add_peer(self, metadata: bytes) -> str:
        """Check and load a peer's metadata; returns its name. Raises LayoutMismatch."""

    def remove_peer(self, name: str) -> None: ...

    def read(self, peer: str, remote_blocks, local_blocks, layers=None) -> Transfer:
        """Pull the peer's `remote_blocks` into our `local_blocks` (same length, any order)."""

    def write(self, peer: str, local_blocks, remote_blocks, layers=None) -> Transfer:
        """Push our `local_blocks` into the peer's `remote_blocks`, optionally only some layers."""

    def poll(self, transfer: Transfer) -> TransferStatus: ...

    def release(self, transfer: Transfer) -> None: ...

    def notify(self, peer: str, message: bytes) -> None:
        """Send a small message to a peer (delivered after transfers posted before it)."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Messages received since the last call, as (peer name, bytes)."""

    def close(self) -> None: ...


class PollBackoff:
    """How soon a side of a handoff wants its next poll while something is in flight. Most
    transports have no wait to block on (NIXL's notifications and transfer states are polled; its
    busy progress thread is off), so polls start fast after progress and back off while nothing
    happens: a handoff costs at most `max_s` of added latency per message, and an idle worker
    (nothing in flight) is not polled at all."""

    def __init__(self, min_s: float = 5e-5, max_s: float = 1e-3):
        self.min_s, self.max_s = min_s, max_s
        self.current = min_s

    def next(self, active: bool, progressed: bool) -> float | None:
        if not active:
            self.current = self.min_s
            return None
        self.current = self.min_s if progressed else min(self.max_s, self.current * 2)
        return self.current
