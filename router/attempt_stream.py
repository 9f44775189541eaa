"""One attempt of a request on one worker (router/attempts.py runs them): the control call that
starts it and the deltas that come back over the token stream (`cluster/token_stream.py`), keyed
per attempt so that a late frame from a dead worker never reaches its retry. The call returns when
the request has ended (its last frame then on the wire) and raises when the worker dies; what it
raises or answers reaches the reader through the attempt's queue."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

from cluster.errors import RequestError, error_message
from cluster.token_stream import StreamBroken, StreamQueue, TokenReceiver
from cluster.types import Fork, TokenDelta, merge_deltas
from cluster.worker_messages import DecodeCall, GenerateCall, PrefillCall, PrefillResult
from router.merging import FirstDeltaFirst, merge_per_request
from router.workers import WorkerClient


class CallFailed(Exception):
    """The one call itself raised (its prefill worker's fault, not the decode's): `cause`."""

    def __init__(self, cause: BaseException):
        super().__init__(error_message(cause))
        self.cause = cause


class NotHandedOn(Exception):
    """The prefill worker answered with its result instead of streaming it and handing the request
    on (a worker that does not hand on): the router continues it with its own decode call."""

    def __init__(self, result: PrefillResult):
        super().__init__(result.request_id)
        self.result = result


class AttemptStreams:
    """The attempts in flight, by the decode worker that serves them (`live`: what a drain stops)."""

    def __init__(self, receiver: TokenReceiver, final_delta_grace_s: float):
        self.receiver = receiver
        self.final_delta_grace_s = final_delta_grace_s
        self.live: dict[str, set[StreamQueue]] = {}  # decode worker -> its attempts' queues (what a drain stops)

    async def run(self, start: Callable[[WorkerClient, GenerateCall | DecodeCall | PrefillCall], Awaitable],
                  client: WorkerClient, request_id: str, make: Callable[..., GenerateCall | DecodeCall | PrefillCall],
                  forks: tuple[Fork, ...] = (), firsts: dict[str, TokenDelta] | None = None,
                  drains: str | None = None) -> AsyncIterator[TokenDelta]:
        """One attempt on one worker: start it with a call (through `start(client, call)`, which
        counts it) (`make(sink, key, forks=...)`, each fork
        given its own stream key; a `PrefillCall` is a handed-on request's one call), read its
        deltas from the token stream, each request's first as it arrived kept in `firsts`. Several
        deltas that arrived together leave as one (a lagging reader coalesces). The attempt ends
        when the request and every fork have finished, or when decode worker `drains` is drained."""
        key, queue = self.receiver.open(request_id)
        live = self.live.setdefault(drains, set()) if drains else set()
        live.add(queue)
        forks = tuple(replace(f, stream_key=self.receiver.open(f.request_id, queue)[0]) for f in forks)
        keys = [key, *(f.stream_key for f in forks)]
        running, watch = 1 + len(forks), None
        try:
            call = make(self.receiver.address, key, forks=forks)
            handed_on = isinstance(call, PrefillCall)
            order = FirstDeltaFirst() if handed_on else None
            watch = asyncio.ensure_future(self._watch(start(client, call), queue, handed_on))
            while True:
                items = await queue.take()
                if order is not None:
                    items = order.arrange(items)
                    if not items:
                        continue
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    if firsts is not None:
                        firsts.setdefault(item.request_id, item)
                for delta in (merge_deltas(items),) if not forks else merge_per_request(items):
                    yield delta
                    if delta.finish_reason is not None:
                        running -= 1
                if running == 0:
                    return
        finally:
            live.discard(queue)
            for k in keys:
                self.receiver.close_key(k)
            if watch is not None:
                watch.cancel()

    async def _watch(self, call, queue: StreamQueue, handed_on: bool = False) -> None:
        """The attempt's call: it raises if the worker dies (Ray knows), and returns once the
        request has ended, by which time its last frame is on the wire. A handed-on request's
        answer carries the decode call's error, raised as that call's; the call's own error is
        its prefill worker's (`CallFailed`)."""
        try:
            answer = await call
        except asyncio.CancelledError:
            raise
        except RequestError as exc:
            queue.push(exc)
            return
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.push(CallFailed(exc) if handed_on else exc)
            return
        if isinstance(answer, PrefillResult) and (not answer.streamed or answer.decode_error is not None):
            queue.push(NotHandedOn(answer) if not answer.streamed else answer.decode_error)
            return
        await asyncio.sleep(self.final_delta_grace_s)
        queue.push(StreamBroken("the worker ended the request but its last delta never arrived"))
