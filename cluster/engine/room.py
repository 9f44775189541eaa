"""Room in a full pool, for the scheduler: preemption by recompute, and handed-off waiters.

When a running request needs a block and none is free, the most recently admitted request is
preempted (`Scheduler.preempt`: its blocks freed, its tokens recomputed later), so the oldest
request always progresses and the engine cannot deadlock.

A handed-off (P/D) request waits holding the blocks its KV was pulled into; it keeps them while it
cannot get its next block, since blocks that running requests or pulls in flight hold come back.
Transferred KV is thrown away (the waiter is recomputed from its prompt and first token; counted
in `kv_discarded`) only when waiting could deadlock: a running request alone in the batch that
needs a block takes them from the youngest waiters holding blocks, and so does the head of the
queue when nothing runs. No request is cut short or stalled by blocks other requests hold; one
waits (`StepPlan.stalled`) for blocks held outside the scheduler (pulls in flight, KV held for a
consumer), and is ended with LENGTH, holding nothing, only when it alone outgrows the pool.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from cluster.engine.sequence import Sequence
from cluster.kv.block_pool import BlockPool
from cluster.types import FinishReason

log = logging.getLogger(__name__)


class StepPlan(Protocol):
    """What room needs of the scheduler's plan (`cluster/engine/scheduler.py` `StepPlan`)."""

    stalled: list[Sequence]


class Scheduler(Protocol):
    """What room needs of the scheduler (`cluster/engine/scheduler.py` `Scheduler`, which calls
    room: named here, so that room does not import it back)."""

    pool: BlockPool
    waiting: deque[Sequence]
    running: list[Sequence]
    ended: list[Sequence]
    kv_discarded: int

    def blocks_for(self, num_tokens: int) -> int: ...
    def preempt(self, seq: Sequence, plan: StepPlan) -> None: ...
    def release(self, seq: Sequence) -> None: ...
    def finish(self, seq: Sequence, reason: FinishReason) -> None: ...


def reserve(sched: Scheduler, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
    """Make running `seq` hold blocks for `num_tokens`: preempt younger requests, and once alone
    take the blocks of handed-off waiters. False when `seq` gave way, waits or was ended."""
    pool = sched.pool
    need = sched.blocks_for(num_tokens - seq.cache_offset) - len(seq.block_ids)
    while need > pool.num_free:
        if len(sched.running) > 1:
            victim = sched.running[-1]
            sched.preempt(victim, plan)
            if victim is seq:
                return False
        elif not discard_waiter(sched, None, f"{seq.request_id}, alone in the batch, needs a block"):
            if pool.num_used > len(seq.block_ids):
                plan.stalled.append(seq)   # blocks held outside come back: wait for them
            else:
                _end_out_of_blocks(sched, seq)
            return False
    if need > 0:
        seq.block_ids.extend(pool.allocate(need))
    return True


def make_room(sched: Scheduler, head: Sequence, need: int) -> bool:
    """With nothing running, the head of the queue would wait forever on blocks that waiters
    behind it hold: take them, youngest first. Only when that is enough for the head;
    otherwise it waits for blocks held outside (pulls in flight, KV held for a consumer)."""
    if sched.running:
        return False   # running requests give their blocks back: wait for them
    # A waiter's blocks are its own (pulled into fresh blocks, never published to the cache).
    behind = sum(len(w.block_ids) for w in sched.waiting if w is not head)
    if sched.pool.num_free + behind < need:
        return False
    why = f"{head.request_id}, at the head of the queue with nothing running, needs {need} blocks"
    while need > sched.pool.num_free and discard_waiter(sched, head, why):
        pass
    return need <= sched.pool.num_free


def discard_waiter(sched: Scheduler, keep: Sequence | None, why: str) -> bool:
    """Release the youngest waiter holding blocks (not `keep`): its transferred KV is thrown
    away and it is recomputed from its tokens later. False when no waiter holds any."""
    for w in reversed(sched.waiting):
        if w.block_ids and w is not keep:
            log.warning("discarding the transferred KV of %s (%d blocks): %s", w.request_id,
                        len(w.block_ids), why)
            sched.release(w)
            sched.kv_discarded += 1
            return True
    return False


def _end_out_of_blocks(sched: Scheduler, seq: Sequence) -> None:
    """The pool cannot hold `seq` even alone: end it with LENGTH. Its blocks go back to the
    pool, never to `on_hold` (a partial prefill has no token to hand off)."""
    sched.release(seq)
    sched.finish(seq, FinishReason.LENGTH)
    sched.ended.append(seq)
