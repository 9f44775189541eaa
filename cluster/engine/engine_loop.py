"""Runs an LLMEngine on its own thread and serves it to asyncio code.

Callers never touch the engine directly: they `call` a function on the engine thread (between
steps) or `stream` a request's deltas into an asyncio queue. The thread steps while there is work
and sleeps on its command queue otherwise; `pollers` (the KV producer's and consumer's `poll`) run
on every turn, so leases and transfers progress even when no request is decoding.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from cluster.engine.engine import LLMEngine
from cluster.types import TokenDelta

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, pollers: list[Callable[[], None]] | None = None,
                 idle_wait_s: float = 0.005):
        self.engine = engine
        self.pollers = list(pollers or [])
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- API for asyncio code ----------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run `fn(engine)` on the engine thread; returns a concurrent Future."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    async def acall(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    async def stream(self, request_id: str, start: Callable[[LLMEngine], Any]) -> AsyncIterator[TokenDelta]:
        """Register a stream for `request_id`, run `start(engine)` (which adds the request) on the
        engine thread, then yield its deltas until the finishing one. Cancelling the consumer
        aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        finished = False
        try:
            await self.acall(start)
            while True:
                delta = await q.get()
                if isinstance(delta, BaseException):
                    raise delta
                yield delta
                if delta.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.call(lambda e: e.abort(request_id))

    def abort(self, request_id: str) -> Future:
        return self.call(lambda e: e.abort(request_id))

    def close(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    # --- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            try:
                item = self._commands.get(timeout=0 if busy else self.idle_wait_s)
            except queue.Empty:
                item = False
            while item:
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = False
            if item is None:
                break
            for poll in self.pollers:
                try:
                    poll()
                except Exception:  # noqa: BLE001 - a poller must not stop the engine
                    log.exception("poller failed")
            if self.engine.has_unfinished():
                try:
                    deltas = self.engine.step()
                except Exception as exc:  # noqa: BLE001
                    log.exception("engine step failed")
                    deltas = []
                    for loop, q in list(self._streams.values()):
                        loop.call_soon_threadsafe(q.put_nowait, exc)
                for d in deltas:
                    target = self._streams.get(d.request_id)
                    if target is not None:
                        target[0].call_soon_threadsafe(target[1].put_nowait, d)
