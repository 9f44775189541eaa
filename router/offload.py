"""The CPU-heavy part of taking a request in (JSON parsing, tokenization, chat template rendering)
runs here, in a small thread pool, never on the frontend's event loop: one large request must not
stall every other client's stream, `/health` or gRPC call while it is validated.

Tokenization goes through the tokenizer's batch API, which releases the GIL while it works (its
single-text `encode` holds it throughout: a 3.9 MB prompt held the loop for 4 s). The pool is
bounded: with `max_pending` jobs already queued, a new one is refused (429) instead of queueing
without end.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from router.admission import Refused, RefusedWhy


class Offload:
    def __init__(self, threads: int = 2, max_pending: int = 64):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="validate")
        self.max_pending = max_pending
        self.pending = 0

    async def run(self, fn: Callable, *args, **kwargs):
        if self.pending >= self.max_pending:
            raise Refused(RefusedWhy.QUEUE_FULL, f"{self.pending} requests are already being validated; retry later")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))
        finally:
            self.pending -= 1

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def batch_tokenize(tokenizer, add_special_tokens: bool) -> Callable[[str], list[int]]:
    """`text -> ids` through `encode_batch` (which releases the GIL; `encode` does not)."""
    def tokenize(text: str) -> list[int]:
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenize
