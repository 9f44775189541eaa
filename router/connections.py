"""Connection limits for both front doors: no connection is held open by a client that sends
nothing, sends its headers a byte at a time (slowloris) or never finishes its body.

HTTP (uvicorn's h11 protocol, with the two timers it lacks):
  - idle: a connection with no request in progress (a new one, or kept alive after a response)
    is closed after `http_idle_timeout_s` without a byte;
  - headers: from a request's first byte, its headers must be complete within
    `http_header_timeout_s`, however the bytes trickle in;
  - body: `http_body_timeout_s` to read the whole body (router/openai/http_server.py answers 408);
  - `http_max_connections`: past it, uvicorn answers 503.
gRPC (core's channel arguments): the handshake within `grpc_handshake_timeout_s`, keepalive pings
to find dead clients, idle connections closed, at most `grpc_max_streams_per_connection` streams,
and optionally a maximum connection age (clients reconnect, and a load balancer sees them anew).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from cluster.config import require, setting

from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    http_header_timeout_s: float = setting(10.0, "HTTP: a request's headers must be complete within this of its "
                                                 "first byte")
    http_body_timeout_s: float = setting(30.0, "HTTP: the whole body must arrive within this (else 408)")
    http_idle_timeout_s: float = setting(30.0, "HTTP: a connection with no request in progress is closed after "
                                               "this (vLLM's, uvicorn's, keep-alive is 5 s; OpenAI clients keep pools)")
    http_max_connections: int = setting(1024, "HTTP: open connections; past it, 503")
    grpc_handshake_timeout_s: float = setting(10.0, "gRPC: a connection's handshake must complete within this")
    grpc_keepalive_s: float = setting(60.0, "gRPC: the server pings a silent client this often ...")
    grpc_keepalive_timeout_s: float = setting(20.0, "... and drops it when no answer comes within this")
    grpc_idle_timeout_s: float = setting(300.0, "gRPC: a connection with no call in progress is closed after this")
    grpc_max_connection_age_s: float | None = setting(None, "gRPC: then GOAWAY (calls in progress get as long "
                                                            "again; clients reconnect)", default_text="no limit")
    grpc_max_streams_per_connection: int = setting(128, "gRPC: concurrent calls on one connection")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            require(value is None or value > 0, f.name, f"must be > 0, got {value}")


def guarded_h11(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with an idle timer from the first moment and a header deadline."""
    class GuardedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            # uvicorn arms its keep-alive timer only after a response: a connection that never
            # sends a byte would otherwise stay open for good.
            self.timeout_keep_alive_task = self.loop.call_later(limits.http_idle_timeout_s,
                                                                self.timeout_keep_alive_handler)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._between_requests():
                self._header_timer = self.loop.call_later(limits.http_header_timeout_s, self._headers_late)
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and not self._between_requests():
                self._header_timer.cancel()     # the headers are in: the body has its own deadline
                self._header_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers took over %ss",
                                 limits.http_header_timeout_s)
                # Raw bytes: h11 cannot answer a request whose headers it has not seen.
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)
    return GuardedH11


def grpc_options(limits: ConnectionLimits, max_message_bytes: int) -> list[tuple[str, int]]:
    ms = lambda s: int(s * 1000)  # noqa: E731
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.server_handshake_timeout_ms", ms(limits.grpc_handshake_timeout_s)),
            ("grpc.keepalive_time_ms", ms(limits.grpc_keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(limits.grpc_keepalive_timeout_s)),
            ("grpc.max_connection_idle_ms", ms(limits.grpc_idle_timeout_s)),
            ("grpc.max_concurrent_streams", limits.grpc_max_streams_per_connection),
            *([("grpc.max_connection_age_ms", ms(limits.grpc_max_connection_age_s)),
               ("grpc.max_connection_age_grace_ms", ms(limits.grpc_max_connection_age_s))]
              if limits.grpc_max_connection_age_s else []),
            # A client may ping at most every 10 s without data; two strikes and it is dropped.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 2)]
