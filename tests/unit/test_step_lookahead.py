"""The step's lookahead cap follows measured throughput per batch size: where speculation pays it
is used, where it does not (large batches) the batch decodes plainly, apart from a small share of
exploring steps; a step with prompt chunks is neither timed nor explored."""
import pytest

from decode.spec import step_policy
from decode.spec.step_policy import StepLookahead, StepSetting, batch_bucket


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _machine(batch: int, cap: int) -> tuple[float, int]:
    """(seconds, extra tokens) of a step: at batch 1 each verified row is nearly free and 3 of 4
    drafts are accepted; at batch 32 every row costs a decode's share of the step, and 6 of 10
    drafts are accepted."""
    if batch == 1:
        return 0.025 * (1 + 0.05 * cap), round(0.75 * cap)
    return 0.004 * batch * (1 + cap), int(0.6 * cap * batch)


def _run(policy, clock, batch: int, steps: int) -> list[int]:
    caps = []
    for _ in range(steps):
        cap = policy.cap(batch, measured=True)
        seconds, extra = _machine(batch, cap)
        clock.now += seconds
        policy.observe(extra)
        caps.append(cap)
    return caps


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(step_policy.time, "perf_counter", c)
    return c


def test_speculates_where_it_pays_and_decodes_plainly_where_it_does_not(clock):
    policy = StepLookahead(k_max=8, explore=0.05, seed=0)
    small = _run(policy, clock, 1, 400)[-300:]
    large = _run(policy, clock, 32, 400)[-300:]
    assert sum(c == 8 for c in small) >= 0.9 * len(small)
    assert sum(c == 0 for c in large) >= 0.9 * len(large)
    assert 0 < sum(c != 0 for c in large) <= 0.1 * len(large)     # it keeps exploring, a little
    table = policy.table()
    assert table[1]["8"] > 1.5 * table[1]["0"] and table[32]["0"] > 1.2 * table[32]["1"] > 0
    # The first tries climbed from cap 0 and stopped at 1: caps that cost most were never tried.
    assert set(table[32]) == {"0", "1"}


def test_steps_with_prompt_chunks_use_the_best_cap_and_are_not_measured(clock):
    policy = StepLookahead(k_max=4, explore=0.5, seed=1)
    _run(policy, clock, 32, 60)
    before = {k: (a.samples, a.rate) for k, a in policy.arms.items()}
    assert {policy.cap(32, measured=False) for _ in range(50)} == {0}
    clock.now += 5.0
    policy.observe(0)
    assert {k: (a.samples, a.rate) for k, a in policy.arms.items()} == before


def test_tree_leaves_are_an_arm_of_their_own(clock):
    """Leaves add a token now and then for a row each: worth it at batch 1, where rows are nearly
    free, not at batch 32, where each costs a decode's share."""
    policy = StepLookahead(k_max=4, explore=0.05, seed=2, tree_leaves=4)
    assert [(s.cap, s.leaves) for s in policy.settings] == [(0, 0), (1, 0), (1, 4), (2, 0), (2, 4), (4, 0), (4, 4)]

    def run(batch, steps):
        chosen = []
        for _ in range(steps):
            s = policy.choose(batch, measured=True)
            seconds, extra = _machine(batch, s.cap)
            if s.leaves:   # each leaf a row; one in three adds a token
                seconds += (0.025 * 0.01 if batch == 1 else 0.004 * batch) * s.leaves
                extra += s.leaves // 3 * (1 if batch == 1 else batch // 4)
            clock.now += seconds
            policy.observe(extra)
            chosen.append(s)
        return chosen[-200:]
    small, large = run(1, 300), run(32, 300)
    assert sum(s.cap == 4 and s.leaves == 4 for s in small) >= 0.9 * len(small)
    assert sum(s.cap == 0 for s in large) >= 0.9 * len(large)
    assert "4+t" in policy.table()[1] and set(policy.table()[32]) == {"0", "1"}


def test_buckets_and_caps():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [0, 1, 2, 2, 3, 3, 4, 5, 6]
    assert StepLookahead(k_max=3).caps == [0, 1, 2, 3]
    assert StepLookahead(k_max=8).caps == [0, 1, 2, 4, 8]


def test_a_fixed_k_is_tried_first_then_plain_decoding_and_the_faster_kept(clock):
    """The server's fixed k (4, with its tree budget) against plain decoding only: tried as
    configured first, then cap 0; at batch 1 it stays on, at batch 32 the batch decodes plainly."""
    policy = StepLookahead(k_max=8, explore=0.05, seed=3, fixed=StepSetting(4, 2))
    assert policy.settings == [StepSetting(0), StepSetting(4, 2)]
    assert policy.choose(32, measured=False) == StepSetting(4, 2)     # nothing measured: as configured
    small, large = _run(policy, clock, 1, 200), _run(policy, clock, 32, 200)
    assert small[:2 * policy.TRIES] == [4] * policy.TRIES + [0] * policy.TRIES
    assert large[:2 * policy.TRIES] == [4] * policy.TRIES + [0] * policy.TRIES
    assert sum(c == 4 for c in small[-150:]) >= 0.9 * 150
    assert sum(c == 0 for c in large[-150:]) >= 0.9 * 150
    assert set(policy.table()[32]) == {"0", "4+t"}


def test_exploring_takes_a_share_of_the_time_not_of_the_steps(clock):
    """At batch 32 a k = 4 step takes 5 plain steps' time: it is explored a fifth as often as a
    setting of the best's step time would be, so exploring costs about `explore` of the time."""
    policy = StepLookahead(k_max=8, explore=0.05, seed=4, fixed=StepSetting(4))
    large = _run(policy, clock, 32, 2000)[-1500:]
    explored = sum(c == 4 for c in large)
    assert 0 < explored <= 0.02 * len(large)     # 1% expected; 5% if steps were counted
