"""The console of the commands a person reads (`chat`, `serve --request`): one status line while
starting, then only the conversation. Everything else written to stderr (our logs, Ray's, its C++
core's) goes to a log file under the cache while the command runs; `-v` keeps it on the terminal.

A long start step says so by logging with `extra={"phase": "..."}` (converting a GGUF file,
measuring kernels, starting Ray, loading the model): `PhaseHandler` turns those records into the
status line, so the steps need no handle on the console.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Self

REPAINT_S = 0.5          # a terminal's status line: its elapsed time ticks
PLAIN_EVERY_S = 5.0      # a pipe's: a line at each phase, and one every few seconds of a long phase


class Console:
    """The terminal's stderr (`err`), a status line on it, and (quiet) fd 2 sent to `log_path`."""

    def __init__(self, log_path: Path | None):
        self.log_path = log_path
        self._saved_fd: int | None = None
        self.err = sys.stderr
        self._phase: str | None = None
        self._phase_at = self._started = time.monotonic()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._tty = False
        self._last_plain = 0.0

    def __enter__(self) -> Self:
        if self.log_path is None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self.err = os.fdopen(os.dup(self._saved_fd), "w", buffering=1)
        self._tty = self.err.isatty()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)             # Python's stderr, Ray's and the C++ core's lines: the file
        os.close(fd)
        self.note(f"splitserve: logs in {self.log_path} (-v shows them here)")
        self._thread = threading.Thread(target=self._repaint, name="console-status", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done()
        if self._saved_fd is not None:
            sys.stderr.flush()
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            self._saved_fd = None

    def phase(self, text: str) -> None:
        """A start step begins: the status line says it, with the time since the command started
        (quiet only: otherwise the logs say it)."""
        if self.log_path is None:
            return
        with self._lock:
            self._phase, self._phase_at = text, time.monotonic()
        self._paint(force=True)

    def done(self, line: str | None = None) -> None:
        """Starting is over: the status line goes (or `line` replaces it)."""
        with self._lock:
            had = self._phase is not None
            self._phase = None
        self._wake.set()
        if self._tty and had:
            self.err.write("\r\033[K")
        if line:
            self.err.write(line + "\n")
        self.err.flush()

    def note(self, line: str) -> None:
        """One line on the terminal's stderr, below the conversation's text."""
        self.err.write(line + "\n")
        self.err.flush()

    def _status(self) -> str | None:
        with self._lock:
            if self._phase is None:
                return None
            return f"splitserve: {self._phase} ... {time.monotonic() - self._started:.0f} s"

    def _paint(self, force: bool = False) -> None:
        text = self._status()
        if text is None:
            return
        now = time.monotonic()
        if self._tty:
            self.err.write("\r\033[K" + text)
        elif force or now - self._last_plain >= PLAIN_EVERY_S:
            self.err.write(text + "\n")
        else:
            return
        self._last_plain = now
        self.err.flush()

    def _repaint(self) -> None:
        while not self._wake.wait(REPAINT_S):
            self._paint()


class PhaseHandler(logging.Handler):
    """Log records that carry a `phase` become the console's status line."""

    def __init__(self, console: Console):
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, "phase", None)
        if phase:
            self.console.phase(phase)


def log_file(cache: Path, command: str) -> Path:
    """Where one run's logs go: `<cache>/logs/<command>-<time>-<pid>.log`."""
    return cache / "logs" / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
