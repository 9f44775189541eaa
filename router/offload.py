"""The CPU-heavy part of taking a request in (JSON parsing, tokenization, chat template rendering)
runs here, in a small thread pool, never on the frontend's event loop: one large request must not
stall every other client's stream, `/health` or gRPC call while it is validated.

Tokenization goes through the tokenizer's batch API, which releases the GIL while it works (its
single-text `encode` holds it throughout: a 3.9 MB prompt held the loop for 4 s). The pool is
bounded: with `max_pending` jobs already queued, a new one is refused (429) instead of queueing
without end. A tenant runs one job at a time, so with two threads another tenant always finds one
free; and the threads run at a lower CPU priority (nice +10) than the engines and the event loop,
so a flood of costly validations takes the CPU that serving leaves, not the CPU serving needs.
"""
from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from router.admission import Refused, RefusedWhy


NICE = 10


def _lower_priority() -> None:
    """Linux keeps a nice value per thread; threads this one starts (the tokenizer's) inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (OSError, AttributeError):      # not Linux, or not allowed: same priority, still off the loop
        pass


class Offload:
    def __init__(self, threads: int = 2, max_pending: int = 64):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="validate", initializer=_lower_priority)
        self.max_pending = max_pending
        self.pending = 0
        self._turns: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._jobs: defaultdict[str, int] = defaultdict(int)   # per tenant, running or waiting its turn

    async def run(self, tenant: str, fn: Callable, *args, **kwargs):
        """`fn(*args, **kwargs)` on a pool thread, after `tenant`'s previous job. A caller that is
        cancelled stops waiting, but its job keeps its tenant's turn (and its place in
        `max_pending`) until the thread is done with it: leaving is no way around the bounds."""
        if self.pending >= self.max_pending:
            raise Refused(RefusedWhy.QUEUE_FULL, f"{self.pending} requests are already being validated; retry later")
        self.pending += 1
        self._jobs[tenant] += 1
        turn = self._turns[tenant]
        try:
            await turn.acquire()
        except BaseException:
            self._finished(tenant, None)
            raise
        job = asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))
        job.add_done_callback(lambda j: (self._finished(tenant, turn), j.cancelled() or j.exception()))
        return await asyncio.shield(job)

    def _finished(self, tenant: str, turn: asyncio.Lock | None) -> None:
        if turn is not None:
            turn.release()
        self.pending -= 1
        self._jobs[tenant] -= 1
        if not self._jobs[tenant]:          # forget idle tenants
            del self._jobs[tenant], self._turns[tenant]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def batch_tokenize(tokenizer, add_special_tokens: bool) -> Callable[[str], list[int]]:
    """`text -> ids` through `encode_batch` (which releases the GIL; `encode` does not)."""
    def tokenize(text: str) -> list[int]:
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenize
