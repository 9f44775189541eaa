"""Online adaptation's decisions (decode/spec/online/policy.py): promotion on held-out traffic,
probation for one window, rollback when the new head accepts less on the window's traffic."""
from decode.spec.online.messages import AcceptanceCount
from decode.spec.online.policy import Phase, TenantPolicy, Verdict


def test_a_candidate_goes_live_only_if_it_beats_the_live_head_by_the_margin():
    p = TenantPolicy(window=10, margin=0.05)
    assert not p.promotes(1.04, 1.0)
    assert p.promotes(1.06, 1.0)
    p.promoted(1)
    assert (p.live, p.previous, p.phase) == (1, 0, Phase.PROBATION)
    assert not p.promotes(5.0, 1.0), "no second promotion while one is on probation"


def test_the_window_counts_only_the_new_heads_verifications():
    p = TenantPolicy(window=10)
    p.promoted(1)
    p.observe([AcceptanceCount("a", 0, 50, 60), AcceptanceCount("a", 1, 6, 9)])
    assert not p.window_full() and p.judge(0.0, 1.0) is Verdict.WAIT
    p.observe([AcceptanceCount("a", 1, 4, 4)])
    assert p.window_full() and p.window_steps == 10


def test_a_head_worse_on_the_windows_traffic_is_rolled_back_to_the_one_before():
    p = TenantPolicy(window=5)
    p.promoted(1)
    p.observe([AcceptanceCount("a", 1, 5, 1)])
    assert p.judge(0.8, 1.1) is Verdict.ROLLBACK
    assert (p.live, p.previous, p.phase) == (0, None, Phase.SERVING)


def test_a_head_that_holds_up_is_kept_and_the_next_round_may_promote():
    p = TenantPolicy(window=5)
    p.promoted(1)
    p.observe([AcceptanceCount("a", 1, 7, 9)])
    assert p.judge(1.3, 1.1) is Verdict.KEEP
    assert (p.live, p.previous, p.phase) == (1, None, Phase.SERVING)
    assert p.promotes(1.5, 1.3)


def test_a_gain_within_the_noise_of_the_held_out_set_is_not_a_promotion():
    p = TenantPolicy(window=10, margin=0.02)
    assert not p.promotes(1.10, 1.0, noise=0.06)
    assert p.promotes(1.10, 1.0, noise=0.04)
