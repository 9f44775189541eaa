"""Choosing a transport is configuration: NIXL by default, with a clear message when the chosen
one cannot be loaded here (each transport imports its optional library, nixl or ucxx, when made)."""
from __future__ import annotations

from cluster.config import TRANSPORTS
from cluster.transfer.base import TransportUnavailable
from cluster.transfer.cuda_ipc import CudaIpcTransport
from cluster.transfer.loopback import LoopbackTransport
from cluster.transfer.nixl_transport import NixlTransport
from cluster.transfer.tcp import TcpTransport
from cluster.transfer.ucx_transport import UcxTransport

_MAKERS = {"nixl": NixlTransport, "ucx": UcxTransport, "tcp": TcpTransport, "cuda_ipc": CudaIpcTransport,
           "loopback": lambda agent_name, **_: LoopbackTransport(agent_name)}
assert tuple(_MAKERS) == TRANSPORTS, "cluster/config.py's TRANSPORTS names every transport made here"


def make_transport(kind: str, agent_name: str, **options):
    if kind not in _MAKERS:
        raise TransportUnavailable(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
    return _MAKERS[kind](agent_name, **options)
