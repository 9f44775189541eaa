"""Runs an LLMEngine on its own thread and serves it to asyncio code.

Callers never touch the engine directly: they `call` a function on the engine thread (between
steps) or `run` a request to its end. A request's deltas leave the thread once per step: those
bound for a frontend go out as one frame per frontend (`cluster/token_stream.py`); the caller's
coroutine only learns the final delta, through one future per request.

Nothing spins when idle. The thread steps while the engine has work; otherwise it sleeps on its
command queue until the next command, with no timeout at all. An engine that has work but could
schedule none of it (`engine.idle_step`: e.g. the next request waits for blocks that pulls in
flight hold) sleeps the same way until a command changes something, never spins. KV handoffs run
on a thread of their own (cluster/transfer/progress.py), never between steps: what they change in
the engine (blocks freed, a pulled sequence joining the batch) comes here as a command (`soon`).

While it steps, the loop also pushes the worker's stats (`stats_frame`) to the frontends its
requests came from, at most every `STATS_PUSH_S`: the router's load view rides the token stream.

`steps` counts the steps that did work: the router's progress watchdog (`router/health.py`) calls a
worker stuck when it has work and this counter stands still.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from cluster.engine.engine import LLMEngine
from cluster.token_stream import STATS_PUSH_S, KeyedDelta, SinkAddress, StreamBroken, StreamError, TokenSender, \
    encode_errors, encode_step
from cluster.types import Fork, TokenDelta, merge_deltas

log = logging.getLogger(__name__)

@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future        # resolves with the request's final delta (or `on_end`'s result)
    sink: SinkAddress | None    # None: only the final delta is wanted (e.g. a prefill)
    key: int
    on_end: Callable[[LLMEngine, TokenDelta], Any] | None = None   # runs on the engine thread
    held: list = field(default_factory=list)    # deltas waiting for `stream_interval` tokens
    sent: bool = False
    stats_sink: SinkAddress | None = None      # where this worker's stats go while the request runs


class EngineLoop:
    def __init__(self, engine: LLMEngine, sender: TokenSender | None = None, stream_interval: int = 1,
                 stats_frame: Callable[[], bytes] | None = None,
                 on_deltas: Callable[[list[TokenDelta]], None] | None = None,
                 on_broken: Callable[[], None] | None = None):
        """`stream_interval`: a stream's deltas leave once it has this many new tokens (its first
        and last leave at once), as vLLM's `--stream-interval`: fewer messages per token for the
        frontends, at the cost of burstier inter-token times. `stats_frame`: the worker's stats as
        an encoded frame, built on the engine thread when a push is due. `on_deltas`: sees each
        step's deltas on the engine thread before they leave (a role's observer, e.g. the decode
        handoff's timing). `on_broken`: called once a tensor-parallel engine's step failed (a rank
        dead or past the collective deadline: the group is unusable; a worker ends its process so
        that Ray restarts it)."""
        self.engine = engine
        self.on_broken = on_broken
        self.stats_frame = stats_frame
        self._stats_pushed = 0.0        # monotonic time of the last push
        self.stream_interval = stream_interval
        self.sender = sender
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}     # touched on the engine thread only
        self.on_deltas = on_deltas
        self.steps = 0                  # steps that did work (read by the progress watchdog)
        self._idle_at: tuple | None = None   # the queue sizes of an idle step: sleep until they change
        self._stop = threading.Event()
        if engine.tiers is not None:   # a finished tier job wakes an idle loop to poll it
            engine.tiers.notify = lambda: self.soon(_nothing)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- API for asyncio code ----------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run `fn(engine)` on the engine thread; returns a concurrent Future."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    def soon(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run `fn(engine)` on the engine thread: now when called there (an abort that ends a
        lease frees its blocks in the same turn), else as the next command."""
        if threading.current_thread() is self._thread:
            fn(self.engine)
        else:
            self.call(fn).add_done_callback(_log_failure)

    async def acall(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def register(self, request_id: str, done: asyncio.Future, sink: SinkAddress | None, key: int,
                 on_end: Callable[[LLMEngine, TokenDelta], Any] | None = None,
                 stats_sink: SinkAddress | None = None) -> None:
        """Engine thread only: deltas of `request_id` go to `sink`; its end resolves `done` with
        the final delta, or with `on_end(engine, final delta)` run on this thread at once (a
        prefill publishes its KV there, without waiting for another turn of the loop). While it
        runs, stats go to `stats_sink` (default `sink`)."""
        self._streams[request_id] = _Stream(done.get_loop(), done, sink, key, on_end, stats_sink=stats_sink or sink)

    def has_stream(self, request_id: str) -> bool:
        """Engine thread only: the request is still registered (its caller waits for its end)."""
        return request_id in self._streams

    def forget(self, request_id: str) -> None:
        """Engine thread only: the request never started (its start failed)."""
        self._streams.pop(request_id, None)

    async def run(self, request_id: str, start: Callable[[LLMEngine], Any], sink: SinkAddress | None = None,
                  key: int = 0, on_end: Callable[[LLMEngine, TokenDelta], Any] | None = None,
                  forks: tuple[Fork, ...] = (), abort: Callable[[LLMEngine, str], Any] | None = None,
                  stats_sink: SinkAddress | None = None) -> Any:
        """Register `request_id` and its `forks` (more samples of its prompt, each streamed to the
        same sink under its `stream_key`), run `start(engine)` on the engine thread and wait for
        every final delta; returns the request's own. `start` may fail (the worker is busy, the
        request is refused): then nothing stays registered and its exception is the caller's.
        Cancelling the caller runs `abort(engine, request id)` (default `engine.abort`) for each.
        `stats_sink`: the frontend to push stats to when `sink` is None (a prefill's caller)."""
        loop = asyncio.get_running_loop()
        ids = [request_id, *(f.request_id for f in forks)]
        dones = [loop.create_future() for _ in ids]
        stop = abort or (lambda e, rid: e.abort(rid))

        def begin(e: LLMEngine):
            self.register(request_id, dones[0], sink, key, on_end, stats_sink)
            for f, done in zip(forks, dones[1:]):
                self.register(f.request_id, done, sink, f.stream_key or 0)
            try:
                return start(e)
            except BaseException:
                for rid in ids:
                    self.forget(rid)
                raise

        def abort_all(e: LLMEngine) -> None:
            for rid in ids:
                stop(e, rid)
        try:
            await self.acall(begin)
        except asyncio.CancelledError:     # `begin` may still run: abort whatever it started
            self.call(abort_all)
            raise
        try:
            results = await asyncio.shield(asyncio.gather(*dones, return_exceptions=True))
        except asyncio.CancelledError:
            self.call(abort_all)
            raise
        for r in results:                  # one raising fails the call, once all have ended
            if isinstance(r, BaseException):
                raise r
        return results[0]

    def close(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)
        if self.sender is not None:
            self.sender.close()

    # --- the engine thread -----------------------------------------------------------------------
    def _queue_sizes(self) -> tuple:
        sched = self.engine.scheduler
        return len(sched.waiting), len(sched.running), sched.pool.num_free

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = None
            if self.engine.has_unfinished() and self._idle_at != self._queue_sizes():
                wait = 0.0
            try:
                item = self._commands.get(timeout=wait) if wait != 0.0 else self._commands.get_nowait()
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
            if self.engine.has_unfinished():
                self._step()
            else:
                self._idle_at = None

    def _step(self) -> None:
        push_to = self._stats_due()
        try:
            deltas = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - every stream of this worker fails, the worker lives
            log.exception("engine step failed")
            self._fail_all(exc)
            if self.engine.ranks is not None:
                self._group_broken()
            return
        idle = self.engine.idle_step and not deltas
        self._idle_at = self._queue_sizes() if idle else None
        if not idle:
            self.steps += 1
        self.emit(deltas)
        if push_to:
            self._push_stats(push_to)

    def _group_broken(self) -> None:
        """A failed step of a tensor-parallel engine leaves its group unusable: its ranks are killed
        and the loop stops; the worker is dead, as a single process whose engine died."""
        log.error("a tensor-parallel rank failed or hung: the worker's ranks are stopped")
        self.engine.ranks.kill()
        self._stop.set()
        if self.on_broken is not None:
            self.on_broken()

    def _stats_due(self) -> set[SinkAddress]:
        """The frontends to push stats to after this step (those of the requests running before
        it, so the push that follows a request's end reaches its frontend); none if not due."""
        if self.stats_frame is None or time.monotonic() - self._stats_pushed < STATS_PUSH_S:
            return set()
        return {s.stats_sink for s in self._streams.values() if s.stats_sink is not None}

    def _push_stats(self, sinks: set[SinkAddress]) -> None:
        self._stats_pushed = time.monotonic()
        try:
            frame = self.stats_frame()
        except Exception:  # noqa: BLE001 - the router polls over Ray instead
            log.exception("building the stats frame failed")
            return
        for sink in sinks:
            if not self.sender.send(sink, frame):
                self._sink_broke(sink)

    def emit(self, deltas: list[TokenDelta]) -> None:
        """Engine thread only: send one step's deltas (one frame per frontend), then resolve the
        requests that ended."""
        frames: dict[SinkAddress, list[KeyedDelta]] = {}
        ended: list[tuple[_Stream, TokenDelta]] = []
        if self.on_deltas is not None:
            self.on_deltas(deltas)
        for d in deltas:
            s = self._streams.get(d.request_id)
            if s is None:
                continue
            if s.sink is not None:
                if self.stream_interval > 1 and s.sent and not d.finished:
                    s.held.append(d)
                    if sum(len(h.token_ids) for h in s.held) < self.stream_interval:
                        continue
                    d, s.held = merge_deltas(s.held), []
                elif s.held:
                    d, s.held = merge_deltas([*s.held, d]), []
                s.sent = True
                frames.setdefault(s.sink, []).append(KeyedDelta(s.key, d))
            if d.finished:
                del self._streams[d.request_id]
                ended.append((s, d))
        for sink, records in frames.items():
            if not self.sender.send(sink, encode_step(records)):
                self._sink_broke(sink)
        # Resolve after sending, so a request's call returns only once its last frame is written.
        for s, d in ended:
            value = d
            if s.on_end is not None:
                try:
                    value = s.on_end(self.engine, d)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    value = exc
            s.loop.call_soon_threadsafe(_resolve, s.done, value)

    def fail(self, request_id: str, exc: BaseException) -> None:
        """Engine thread only: end a registered request that never reached the engine."""
        s = self._streams.pop(request_id, None)
        if s is not None:
            if s.sink is not None and not self.sender.send(s.sink, encode_errors([StreamError(s.key, str(exc))])):
                self._sink_broke(s.sink)
            s.loop.call_soon_threadsafe(_resolve, s.done, exc)

    def _sink_broke(self, sink: SinkAddress) -> None:
        for rid, s in list(self._streams.items()):
            if s.sink == sink:
                del self._streams[rid]
                self.engine.abort(rid)
                s.loop.call_soon_threadsafe(_resolve, s.done, StreamBroken(f"frontend {sink.frontend} unreachable"))

    def _fail_all(self, exc: Exception) -> None:
        by_sink: dict[SinkAddress, list[StreamError]] = {}
        for rid, s in list(self._streams.items()):
            self.engine.abort(rid)
            if s.sink is not None:
                by_sink.setdefault(s.sink, []).append(StreamError(s.key, f"engine step failed: {exc}"))
            s.loop.call_soon_threadsafe(_resolve, s.done, RuntimeError(f"engine step failed: {exc}"))
        self._streams.clear()
        for sink, errors in by_sink.items():
            self.sender.send(sink, encode_errors(errors))


def _nothing(engine: LLMEngine) -> None:
    """A command that only wakes the loop: the next step polls what changed."""


def _log_failure(fut: Future) -> None:
    """A `soon` command has no caller to raise to: its failure is logged, never dropped."""
    if not fut.cancelled() and fut.exception() is not None:
        log.error("engine-thread command failed", exc_info=fut.exception())


def _resolve(fut: asyncio.Future, value) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
