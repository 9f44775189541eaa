"""How the disk tier moves a block's bytes between memory and its file.

`NixlFileIO`: through NIXL's POSIX backend (the storage side of the transport: the same agent API
a GPU cluster points at GPUDirect Storage with the GDS backend). The tier thread's payloads go
through one registered host buffer of a block's size; each file is registered for the one
transfer and released after it. `PlainFileIO`: Python's buffered reads and writes. `make_file_io`
picks NIXL where its POSIX backend loads, plain files otherwise, and says which in the log.

Only the payload moves this way; the small header before it (magic, checksum, size) is plain I/O.
Both are used by one thread at a time (the tier thread), as the disk tier is.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from typing import BinaryIO, Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0


class FileIO(Protocol):
    name: str

    def write(self, f: BinaryIO, offset: int, payload: memoryview) -> None:
        """`payload` at `offset` of the open file `f` (opened for writing)."""

    def readinto(self, f: BinaryIO, offset: int, out: memoryview) -> int:
        """Fill `out` from `offset` of `f`; the bytes read."""


class PlainFileIO:
    name = "plain"

    def write(self, f: BinaryIO, offset: int, payload: memoryview) -> None:
        f.seek(offset)
        f.write(payload)

    def readinto(self, f: BinaryIO, offset: int, out: memoryview) -> int:
        f.seek(offset)
        return f.readinto(out)


class NixlFileIO:
    name = "nixl-posix"

    def __init__(self, block_bytes: int, backend: str = "POSIX"):
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415 - optional dependency
        self.agent_name = f"kv-disk-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(backends=[backend]))
        self.buffer = torch.empty(block_bytes, dtype=torch.uint8)
        self._view = self.buffer.numpy()
        self._reg = self.agent.register_memory([self.buffer])

    def write(self, f: BinaryIO, offset: int, payload: memoryview) -> None:
        n = payload.nbytes
        self._view[:n] = np.frombuffer(payload, dtype=np.uint8)
        f.flush()        # the header went through Python's buffer: it lands before the payload's pwrite
        self._move("WRITE", f.fileno(), offset, n)

    def readinto(self, f: BinaryIO, offset: int, out: memoryview) -> int:
        n = out.nbytes
        size = os.fstat(f.fileno()).st_size
        if size < offset + n:
            return max(0, size - offset)         # a short file: the caller drops it
        self._move("READ", f.fileno(), offset, n)
        np.frombuffer(out, dtype=np.uint8)[:] = self._view[:n]
        return n

    def _move(self, op: str, fd: int, offset: int, n: int) -> None:
        files = self.agent.register_memory([(offset, n, fd, "")], "FILE")
        try:
            local = self.agent.get_xfer_descs([(self.buffer.data_ptr(), n, 0)], "DRAM")
            handle = self.agent.initialize_xfer(op, local, files.trim(), self.agent_name)
            try:
                state, limit = self.agent.transfer(handle), time.monotonic() + TRANSFER_TIMEOUT_S
                while state != "DONE":
                    if state == "ERR" or time.monotonic() > limit:
                        raise OSError(f"NIXL {op} of {n} bytes failed ({state})")
                    state = self.agent.check_xfer_state(handle)
            finally:
                self.agent.release_xfer_handle(handle)
        finally:
            self.agent.deregister_memory(files)

    def close(self) -> None:
        self.agent.deregister_memory(self._reg)


def make_file_io(block_bytes: int, mode: str = "auto") -> FileIO:
    """`mode`: "nixl" (NIXL's POSIX backend, an error if it does not load), "plain", or "auto"
    (NIXL where it loads)."""
    if mode == "plain":
        return PlainFileIO()
    try:
        io = NixlFileIO(block_bytes)
    except Exception as exc:  # noqa: BLE001 - no NIXL, or no POSIX plugin: plain files
        if mode == "nixl":
            raise RuntimeError(f"--kv-disk-io nixl: NIXL's POSIX backend does not load here ({exc})") from None
        log.info("KV disk tier: plain files (NIXL's POSIX backend does not load: %s)", type(exc).__name__)
        return PlainFileIO()
    log.info("KV disk tier: files through NIXL's POSIX backend")
    return io
