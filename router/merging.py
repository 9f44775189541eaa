"""How a request's deltas are put together on their way to the client: several streams as one
(a group's samples continued apart, or a response's prompts), several deltas of one step as one
per request, and a handed-off request's usage with its prefill worker's prefix-cache hits."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace

from cluster.types import TokenDelta, merge_deltas


def with_prefill_hits(delta: TokenDelta, firsts: Mapping[str, TokenDelta]) -> TokenDelta:
    """A handed-off request's usage counts the prompt tokens its prefill worker served from its
    prefix cache: the decode worker that ends it computed none of the prompt (it reports 0)."""
    if not delta.finished:
        return delta
    first = firsts.get(delta.request_id)
    if first is None or first.num_cached_tokens <= delta.num_cached_tokens:
        return delta
    return replace(delta, num_cached_tokens=first.num_cached_tokens)


def merge_per_request(items: list[TokenDelta]) -> list[TokenDelta]:
    """Deltas of several requests as one per request, in the order each first appeared."""
    by_id: dict[str, list[TokenDelta]] = {}
    for d in items:
        by_id.setdefault(d.request_id, []).append(d)
    return [merge_deltas(ds) for ds in by_id.values()]


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they come; the first error ends them all."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(end)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await queue.put(exc)
    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


class FirstDeltaFirst:
    """A handed-on request's deltas in stream order. Its first delta (each fork's too) comes from
    the prefill worker and the rest from the decode worker, over two connections to the token
    receiver: under load the decode worker's can be read first. A delta that starts past the
    first token (`num_output_tokens` counts the whole output) waits for the first."""

    def __init__(self):
        self.started: set[str] = set()                 # requests whose first delta has been passed on
        self.waiting: dict[str, list[TokenDelta]] = {}

    def arrange(self, items: list) -> list:
        out = []
        for item in items:
            if isinstance(item, BaseException) or item.request_id in self.started:
                out.append(item)
            elif item.num_output_tokens == len(item.token_ids):     # the first: from the prefill worker
                self.started.add(item.request_id)
                out += [item, *self.waiting.pop(item.request_id, ())]
            else:
                self.waiting.setdefault(item.request_id, []).append(item)
        return out
