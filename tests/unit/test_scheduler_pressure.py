"""The scheduler under KV pressure with handed-off (P/D) waiters, over a real block pool and no model.

A handed-off sequence waits holding its transferred blocks; the rules under test: a request is
never cut short or stalled by blocks others hold, a handed-off waiter keeps its KV while it can
wait, head-of-line admission never deadlocks, and a request the pool cannot hold holds nothing.
"""
from __future__ import annotations

import logging

import pytest

from cluster.config import SchedulerConfig
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.kv.block_pool import BlockPool
from cluster.types import FinishReason, SamplingParams

BS = 4
TOKEN = 5   # what the fake model samples (never an eos)


def _sched(num_blocks: int, budget: int = 64) -> Scheduler:
    held = []                    # what the hold hook (prefill/handoff.py in a worker) was given
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), BlockPool(num_blocks), BS, 256, (1,),
                  on_hold=held.append)
    s.held = held
    return s


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(10 + (seed * 31 + i * 7) % 300 for i in range(n))


def _plain(s: Scheduler, rid: str, n: int, max_tokens: int, hold_kv: bool = False) -> Sequence:
    seq = Sequence(rid, _prompt(n, len(rid)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), hold_kv=hold_kv)
    s.add(seq)
    return seq


def _handed_off(s: Scheduler, rid: str, n: int, max_tokens: int) -> Sequence:
    """As `decode.handoff.add_prefilled`: prompt KV in blocks taken at pull time, first token pending."""
    prompt = _prompt(n, len(rid))
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   token_ids=[*prompt, TOKEN], num_computed_tokens=n,
                   block_ids=s.pool.allocate(-(-n // BS)))
    s.add(seq)
    return seq


def _step(s: Scheduler):
    plan = s.schedule()
    s.update(plan, {c.seq: [TOKEN] for c in plan.chunks if c.samples})
    return plan


def _run(s: Scheduler, seqs: list[Sequence], max_steps: int = 200) -> int:
    for i in range(max_steps):
        if not s.has_unfinished():
            return i
        _step(s)
    raise AssertionError(f"no progress: {[(q.request_id, q.status.value) for q in seqs]}")


def _all_complete(s: Scheduler, seqs: list[Sequence]) -> None:
    for seq in seqs:
        assert seq.is_finished and seq.finish_reason is FinishReason.LENGTH
        assert seq.num_output_tokens == seq.sampling.max_tokens, seq.request_id   # never cut short
    assert not s.held
    s.pool.check_idle()


def test_alone_running_request_takes_blocks_from_handed_off_waiters(caplog):
    s = _sched(8)
    a = _plain(s, "a", 10, 20)              # 30 tokens in the end: all 8 blocks
    while a.num_tokens < 13:                # its next decode (position 12) needs a 4th block
        _step(s)
    assert len(a.block_ids) == 3
    b = _handed_off(s, "bb", 8, 6)          # 2 blocks, its pending token needs a 3rd
    c = _handed_off(s, "ccc", 12, 6)        # 3 blocks, needs a 4th: the pool is full now
    assert s.pool.num_free == 0
    with caplog.at_level(logging.WARNING, logger="cluster.engine.scheduler"):
        plan = _step(s)
    assert not a.is_finished and len(a.block_ids) == 4
    assert c.block_ids == [] and c.num_computed_tokens == 0    # the youngest waiter gave its blocks
    assert b.status is SequenceStatus.RUNNING and any(ch.seq is b for ch in plan.decodes)
    assert s.kv_discarded == 1
    assert any("ccc" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    _run(s, [a, b, c])
    _all_complete(s, [a, b, c])


def test_handed_off_waiter_keeps_its_blocks_while_it_can_wait():
    s = _sched(6)
    a = _plain(s, "a", 10, 3)               # 3 blocks for its whole life
    _step(s)
    b = _handed_off(s, "bb", 12, 4)         # 3 blocks; its pending token needs a 4th, none is free
    assert s.pool.num_free == 0
    _step(s)
    assert b.status is SequenceStatus.WAITING and len(b.block_ids) == 3 and b.num_computed_tokens == 12
    starts = []
    while s.has_unfinished():
        plan = _step(s)
        starts += [(ch.start, ch.num_tokens) for ch in plan.chunks if ch.seq is b]
    assert starts[0] == (12, 1)             # decoded from its transferred KV, not recomputed
    assert s.kv_discarded == 0
    _all_complete(s, [a, b])


def test_head_of_line_handed_off_waiter_takes_blocks_from_waiters_behind_it():
    s = _sched(8)
    h1 = _handed_off(s, "h1", 8, 5)         # 2 blocks, needs a 3rd
    h2 = _handed_off(s, "h22", 24, 5)       # 6 blocks: nothing is free and nothing runs
    plan = _step(s)
    assert [ch.seq for ch in plan.decodes] == [h1]
    assert h2.block_ids == [] and s.kv_discarded == 1
    _run(s, [h1, h2])
    _all_complete(s, [h1, h2])


def test_head_of_line_plain_request_takes_blocks_from_handed_off_waiters_behind_it():
    s = _sched(8)
    p = _plain(s, "p", 16, 4)               # needs 4 blocks to start
    h = _handed_off(s, "hh", 28, 4)         # holds 7: one is free
    plan = _step(s)
    assert [ch.seq for ch in plan.prefills] == [p]
    assert h.block_ids == [] and s.kv_discarded == 1
    _run(s, [p, h])
    _all_complete(s, [p, h])


def test_discards_the_youngest_waiters_first_and_only_as_many_as_needed():
    s = _sched(10)
    p = _plain(s, "p", 12, 2)               # needs 3 blocks to start
    h1 = _handed_off(s, "h1", 8, 4)         # 2 blocks each: 8 of 10 held, 2 free
    h2 = _handed_off(s, "h2", 8, 4)
    h3 = _handed_off(s, "h3", 8, 4)
    h4 = _handed_off(s, "h4", 8, 4)
    _step(s)
    assert p.status is SequenceStatus.RUNNING and h1.status is SequenceStatus.RUNNING   # h1 fits in what is left
    assert [bool(h.block_ids) for h in (h1, h2, h3, h4)] == [True, True, True, False]
    assert s.kv_discarded == 1
    _run(s, [p, h1, h2, h3, h4])
    _all_complete(s, [p, h1, h2, h3, h4])


def test_running_request_waits_for_blocks_held_outside_the_scheduler():
    s = _sched(8)
    a = _plain(s, "a", 10, 20)
    while a.num_tokens < 13:
        _step(s)
    pull = s.pool.allocate(s.pool.num_free)   # a pull in flight took the rest
    for _ in range(3):
        plan = _step(s)
        assert plan.empty and a.status is SequenceStatus.RUNNING and not s.take_ended()
    s.pool.free(reversed(pull))               # the pull failed: its blocks come back
    _run(s, [a])
    _all_complete(s, [a])


def test_head_waits_for_blocks_held_outside_and_discards_nothing():
    s = _sched(8)
    h = _handed_off(s, "hh", 8, 3)            # needs a 3rd block
    pull = s.pool.allocate(s.pool.num_free)
    assert _step(s).empty and len(h.block_ids) == 2 and s.kv_discarded == 0
    s.pool.free(reversed(pull))
    _run(s, [h])
    assert s.kv_discarded == 0
    _all_complete(s, [h])


@pytest.mark.parametrize("hold_kv", [False, True])
def test_request_the_pool_cannot_hold_ends_with_length_and_holds_nothing(hold_kv):
    s = _sched(3, budget=4)
    seq = _plain(s, "big", 16, 1, hold_kv=hold_kv)   # 16 prompt tokens: a 4th block it can never get
    _run(s, [seq])
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 0
    assert s.take_ended() == [seq]
    assert not s.held and seq.block_ids == []
    s.pool.check_idle()
