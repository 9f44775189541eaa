"""NIXL descriptor lists name the memory where the bytes are: the peer's own memory type and GPU
ordinal for its blocks (not ours, not device 0), ours for the local list. The agent is a recording
stand-in here (the descriptor logic is ours; the real agents run in tests/e2e, in Ray workers)."""
import threading

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

    def register_memory(self, tensors):
        return "registration"

    def get_agent_metadata(self):
        return b"agent-metadata"

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


def _transport_over(agent) -> "nixl_transport.NixlTransport":
    """A NixlTransport on a recording agent. No real NIXL agent in the test process: one there
    (beside grpc_tools' protobuf, loaded by other tests) crashes it; the real ones run in tests/e2e."""
    transport = object.__new__(nixl_transport.NixlTransport)
    transport.agent_name, transport.agent, transport.peers = "local-agent", agent, {}
    transport.arena = transport.layout = transport._reg = transport._local = None
    transport._lock = threading.RLock()
    return transport


def test_remote_descriptors_use_the_peers_memory_type_and_device():
    agent = RecordingAgent()
    transport = _transport_over(agent)
    arena = torch.zeros(2, 2, 16, 4, 1, 8)
    transport.register(arena, LAYOUT)
    name, descs, mem_type = agent.dlists[-1]
    assert (name, mem_type) == ("NIXL_INIT_AGENT", "DRAM") and (descs[:, 2] == 0).all()
    assert PeerMetadata.decode(transport.metadata()).memory == "DRAM"
    peer = PeerMetadata("p", "nixl", PROTOCOL_VERSION, LAYOUT, 16, 1 << 20, b"x", memory="VRAM", device_id=5)
    transport.add_peer(peer.encode())
    name, descs, mem_type = agent.dlists[-1]
    assert (name, mem_type) == ("peer", "VRAM")
    assert (descs[:, 2] == 5).all() and descs[0, 0] == 1 << 20
