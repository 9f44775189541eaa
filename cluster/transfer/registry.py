"""Choosing a transport is configuration: NIXL by default, with a clear message when the chosen
one cannot be loaded here."""
from __future__ import annotations

from cluster.transfer.base import TransportUnavailable

TRANSPORTS = ("nixl", "ucx", "tcp", "cuda_ipc", "loopback")


def make_transport(kind: str, agent_name: str, **options):
    if kind == "nixl":
        from cluster.transfer.nixl_transport import NixlTransport  # noqa: PLC0415
        return NixlTransport(agent_name, **options)
    if kind == "ucx":
        from cluster.transfer.ucx_transport import UcxTransport  # noqa: PLC0415
        return UcxTransport(agent_name, **options)
    if kind == "tcp":
        from cluster.transfer.tcp import TcpTransport  # noqa: PLC0415
        return TcpTransport(agent_name, **options)
    if kind == "cuda_ipc":
        from cluster.transfer.cuda_ipc import CudaIpcTransport  # noqa: PLC0415
        return CudaIpcTransport(agent_name, **options)
    if kind == "loopback":
        from cluster.transfer.loopback import LoopbackTransport  # noqa: PLC0415
        return LoopbackTransport(agent_name)
    raise TransportUnavailable(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
