"""Helpers every test folder shares (tests/ is on sys.path: tests/conftest.py)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for servers whose address a test must know before they start)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
