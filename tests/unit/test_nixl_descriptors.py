"""NIXL descriptor lists name the memory where the bytes are: the peer's own memory type and GPU
ordinal for its blocks (not ours, not device 0), ours for the local list. The agent is a recording
stand-in here (the descriptor logic is ours; the real agents run in tests/e2e)."""
import numpy as np
import pytest
import torch

from cluster.transfer.base import PROTOCOL_VERSION, PeerMetadata
from cluster.types import KVLayout

nixl_transport = pytest.importorskip("cluster.transfer.nixl_transport")
LAYOUT = KVLayout(model_id="m", num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")


class RecordingAgent:
    def __init__(self):
        self.dlists = []

    def add_remote_agent(self, payload):
        return b"peer"

    def prep_xfer_dlist(self, agent, descs, mem_type):
        self.dlists.append((agent, np.array(descs), mem_type))
        return len(self.dlists)


def test_peer_metadata_carries_memory_and_device():
    meta = PeerMetadata("p", "nixl", PROTOCOL_VERSION, LAYOUT, 16, 4096, b"x", memory="VRAM", device_id=3)
    back = PeerMetadata.decode(meta.encode())
    assert (back.memory, back.device_id) == ("VRAM", 3)
    old = PeerMetadata("p", "nixl", PROTOCOL_VERSION, LAYOUT, 16, 4096, b"x")
    assert (PeerMetadata.decode(old.encode()).memory, old.device_id) == ("DRAM", 0)
    with pytest.raises(ValueError, match="DRAM or VRAM"):
        PeerMetadata("p", "nixl", PROTOCOL_VERSION, LAYOUT, 16, 4096, b"x", memory="HBM")


def test_remote_descriptors_use_the_peers_memory_type_and_device():
    transport = nixl_transport.NixlTransport("local-agent")
    arena = torch.zeros(2, 2, 16, 4, 1, 8)
    transport.register(arena, LAYOUT)
    assert transport.metadata() and PeerMetadata.decode(transport.metadata()).memory == "DRAM"
    agent = RecordingAgent()
    transport.agent = agent
    peer = PeerMetadata("p", "nixl", PROTOCOL_VERSION, LAYOUT, 16, 1 << 20, b"x", memory="VRAM", device_id=5)
    transport.add_peer(peer.encode())
    name, descs, mem_type = agent.dlists[-1]
    assert (name, mem_type) == ("peer", "VRAM")
    assert (descs[:, 2] == 5).all() and descs[0, 0] == 1 << 20
