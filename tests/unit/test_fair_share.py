"""Tenants' fair share of engine steps (cluster/engine/fair_share.py), over the real scheduler and
block pool with a fake model: shares follow weights, nobody starves, a lone tenant gets the whole
step, skipped sequences keep their blocks and resume with the same tokens, and a tenant below its
share of a full batch gets a slot."""
from __future__ import annotations

from collections import Counter

import pytest

from cluster.config import ConfigError, SchedulerConfig
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.kv.block_pool import BlockPool
from cluster.types import FinishReason, SamplingParams

BS = 4


def _sched(fair_tokens: int = 8, weights: str = "", max_num_seqs: int = 64, num_blocks: int = 512,
           budget: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                     fair_step_tokens=fair_tokens, tenant_weights=weights),
                     BlockPool(num_blocks), BS, 512, (1,))


def _fake_token(seq: Sequence) -> int:
    """What the fake model samples: a function of the sequence's tokens so far (never an eos)."""
    return 10 + (sum(seq.token_ids) * 31 + len(seq.token_ids)) % 200


def _add(s: Scheduler, rid: str, tenant: str, prompt_len: int = 3, max_tokens: int = 40) -> Sequence:
    prompt = tuple(10 + (len(rid) * 7 + i * 13) % 300 for i in range(prompt_len))
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant=tenant)
    s.add(seq)
    return seq


def _step(s: Scheduler):
    plan = s.schedule()
    s.update(plan, {c.seq: [_fake_token(c.seq)] for c in plan.chunks if c.samples})
    return plan


def _tokens_by_tenant(plan) -> Counter:
    return Counter({t: sum(c.num_tokens for c in plan.chunks if c.seq.tenant == t)
                    for t in {c.seq.tenant for c in plan.chunks}})


def _run_out(s: Scheduler, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished():
            s.pool.check_idle()
            return
        _step(s)
    raise AssertionError("no progress")


def test_a_lone_tenant_gets_the_whole_step():
    s = _sched(fair_tokens=4)
    seqs = [_add(s, f"a{i}", "hog") for i in range(20)]
    _step(s)                                      # the prompts
    plan = _step(s)
    assert not plan.shared and len(plan.decodes) == 20    # every decode: no fair budget when alone
    for seq in seqs:
        s.finish(seq, FinishReason.ABORT)
    s.pool.check_idle()


@pytest.mark.parametrize("weights,victims,hog_per_step", [("", 6, 6), ("victim=2", 6, 3), ("hog=2", 6, 12),
                                                          ("", 1, 4)])
def test_contended_steps_share_tokens_by_weight(weights, victims, hog_per_step):
    """The lighter tenant's whole demand is served each step, and the hog gets the same per
    weight; never less than its weighted share of `fair_step_tokens` (8: 4 of them, last case)."""
    s = _sched(fair_tokens=8, weights=weights)
    for i in range(40):
        _add(s, f"h{i}", "hog", max_tokens=400)
    for i in range(victims):
        _add(s, f"v{i}", "victim", max_tokens=400)
    for _ in range(20):     # the prompts
        _step(s)
    hog = 0
    for _ in range(40):
        plan = _step(s)
        tokens = _tokens_by_tenant(plan)
        assert tokens["victim"] == victims       # every victim decode, every step
        hog += tokens["hog"]
    assert abs(hog / 40 - hog_per_step) <= 0.5, hog / 40
    _run_out(s)


def test_steps_stay_large_while_every_tenant_has_prompts_to_prefill():
    s = _sched(fair_tokens=8, budget=256)
    for i in range(3):
        _add(s, f"a{i}", "a", prompt_len=40, max_tokens=2)
        _add(s, f"b{i}", "b", prompt_len=40, max_tokens=2)
    plan = _step(s)
    assert plan.shared and _tokens_by_tenant(plan) == {"a": 120, "b": 120}   # a prefill worker's case
    _add(s, "c0", "c", max_tokens=2)         # a tenant with one token's work: small steps again
    _step(s)
    plan = _step(s)
    assert plan.num_tokens <= 8
    _run_out(s)


def test_a_victim_decode_runs_every_step_beside_a_hog():
    s = _sched(fair_tokens=8)
    hogs = [_add(s, f"h{i}", "hog", max_tokens=60) for i in range(64)]
    victim = _add(s, "victim", "victim", prompt_len=10, max_tokens=20)
    _step(s)                                     # the prompts: its 10 tokens beside 10 of the hog's
    assert victim.num_computed_tokens == 10
    steps = 0
    while not victim.is_finished:
        plan = _step(s)
        steps += 1
        assert plan.num_tokens <= 8
    assert steps == 19                           # one decode a step
    assert any(h.status is SequenceStatus.RUNNING and h.block_ids for h in hogs)
    _run_out(s)


def test_no_sequence_starves_and_skipped_ones_keep_their_blocks():
    s = _sched(fair_tokens=4)
    hogs = [_add(s, f"h{i}", "hog", max_tokens=30) for i in range(12)]
    others = [_add(s, f"o{i}", f"t{i}", max_tokens=30) for i in range(3)]
    last_served = {q: 0 for q in hogs + others}
    for step in range(1, 121):
        before = {q: list(q.block_ids) for q in hogs + others if q.status is SequenceStatus.RUNNING}
        plan = _step(s)
        served = {c.seq for c in plan.chunks}
        for q, blocks in before.items():
            if q not in served:                       # skipped: same blocks, nothing freed
                assert q.block_ids == blocks and q.status is SequenceStatus.RUNNING
        for q in served:
            last_served[q] = step
        for q, when in last_served.items():
            # Round robin: the hog's 1 token a step reaches each of its 12 (3-token prompts first).
            assert q.is_finished or step - when <= 12 * 3 + 2, (q.request_id, step, when)
    assert s.num_preemptions == 0
    _run_out(s)
    assert all(q.num_output_tokens == 30 for q in hogs + others)


def test_skipped_sequences_resume_with_the_same_tokens():
    def outputs(contended: bool) -> dict[str, list[int]]:
        s = _sched(fair_tokens=3)
        seqs = [_add(s, f"h{i}", "hog", prompt_len=9, max_tokens=25) for i in range(6)]
        if contended:
            seqs += [_add(s, f"v{i}", "victim", prompt_len=7, max_tokens=25) for i in range(2)]
        _run_out(s)
        return {q.request_id: q.output_token_ids for q in seqs}
    alone, shared = outputs(False), outputs(True)
    assert all(shared[rid] == tokens for rid, tokens in alone.items())


def test_a_tenant_below_its_share_of_a_full_batch_gets_a_slot():
    s = _sched(fair_tokens=8, max_num_seqs=8)
    hogs = [_add(s, f"h{i}", "hog", max_tokens=200) for i in range(8)]
    for _ in range(3):
        _step(s)
    assert all(h.status is SequenceStatus.RUNNING for h in hogs)
    victim = _add(s, "victim", "victim", max_tokens=5)
    _step(s)
    assert victim.status is SequenceStatus.RUNNING and len(s.running) == 8
    assert s.num_preemptions == 1 and sum(h.status is SequenceStatus.WAITING for h in hogs) == 1
    while not victim.is_finished:
        _step(s)
    assert victim.num_output_tokens == 5
    _run_out(s)
    assert all(h.num_output_tokens == 200 for h in hogs)


def test_a_slot_taken_from_a_sequence_in_the_step_gives_its_tokens_back():
    s = _sched(fair_tokens=8, max_num_seqs=2)
    hogs = [_add(s, f"h{i}", "hog", max_tokens=50) for i in range(2)]
    _step(s)
    victim = _add(s, "victim", "victim", max_tokens=5)
    plan = _step(s)                      # both hogs' decodes fit the step: one of them gives way
    assert [c.seq for c in plan.chunks] == [hogs[0], victim] and plan.preempted == [hogs[1]]
    assert hogs[1].block_ids == [] and hogs[1].status is SequenceStatus.WAITING
    _run_out(s)
    assert victim.num_output_tokens == 5 and all(h.num_output_tokens == 50 for h in hogs)


def test_lookahead_counts_toward_the_tenants_share():
    s = _sched(fair_tokens=8)
    for i in range(4):
        _add(s, f"h{i}", "hog", max_tokens=100)
    victim = _add(s, "victim", "victim", max_tokens=100)
    for _ in range(4):
        _step(s)
    plan = s.schedule()
    chunk = next(c for c in plan.decodes if c.seq is victim)
    assert s.lookahead_room(victim, 10, plan) == 3       # its 4 tokens, 1 taken by the decode
    s.attach_draft(plan, chunk, (11, 12, 13))
    s.update(plan, {c.seq: [_fake_token(c.seq)] for c in plan.chunks if c.samples})
    _run_out(s)


def test_tenant_weights_are_checked():
    assert SchedulerConfig(tenant_weights="gold=4, free=0.5").weights() == {"gold": 4.0, "free": 0.5}
    for bad in ("gold", "gold=0", "gold=x", "=2,", "a=inf"):
        if bad == "=2,":
            assert SchedulerConfig(tenant_weights=bad).weights() == {"": 2.0}   # the keyless tenant
            continue
        with pytest.raises(ConfigError, match="tenant_weights"):
            SchedulerConfig(tenant_weights=bad)
    with pytest.raises(ConfigError, match="fair_step_tokens"):
        SchedulerConfig(fair_step_tokens=0)
