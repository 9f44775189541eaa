"""The speculator's step policies through its own step calls (`lookaheads`, `propose`, `verify`,
`after_update`, as `attach_drafts` and the engine make them), with a fake proposer and a fake
clock: a step's timed window covers its drafting, the server's fixed k of greedy requests is
turned off where its drafts cost more than they save (and then no drafting work is done), and
requests that name their own k, or sample, keep it."""
from types import SimpleNamespace

import pytest
import torch

from cluster.config import SpeculativeConfig
from cluster.engine.speculation import Draft, attach_drafts
from cluster.types import SamplingParams
from decode.spec import step_policy
from decode.spec.speculator import SpecDecoder
from decode.spec.step_policy import StepSetting, batch_bucket

VOCAB = 16


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Seq:
    def __init__(self, i: int, sampling: SamplingParams):
        self.request_id, self.sampling, self.token_ids = f"r{i}", sampling, [1, 2, 3]


class FakeProposer:
    """Drafts k tokens of 5s; a call costs `seconds` per sequence on the clock (a model drafter's passes)."""

    def __init__(self, clock: Clock, seconds: float):
        self.clock, self.seconds, self.calls = clock, seconds, 0

    def propose(self, seqs, ks, stop_rules):
        self.calls += 1
        self.clock.now += self.seconds * len(seqs)
        return [Draft((5,) * k) for k in ks]

    def release(self, seq):
        pass


class Scheduler:
    def lookahead_room(self, seq, k, plan):
        return k

    def attach_draft(self, plan, chunk, tokens, parents):
        pass

    def trim_blocks(self, seq):
        pass


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(step_policy.time, "perf_counter", c)
    return c


def _speculator(clock: Clock, draft_seconds: float, k="4", deterministic=False,
                policy=True) -> tuple[SpecDecoder, FakeProposer]:
    spec = SpecDecoder(SimpleNamespace(deterministic=deterministic, speculative=SpeculativeConfig(
        method="ngram", num_speculative_tokens=k if k == "auto" else int(k), spec_fixed_k_policy=policy)))
    proposer = FakeProposer(clock, draft_seconds)
    spec.proposers["ngram"] = proposer
    return spec, proposer


def _step(spec: SpecDecoder, clock: Clock, seqs: list[Seq], base: float, per_row: float) -> dict:
    """One engine step: drafts attached, the target's pass (base + per_row for each row it
    computes, on the clock; every draft token accepted), verification, the update. Returns the
    drafts by sequence."""
    plan = SimpleNamespace(decodes=[SimpleNamespace(seq=s) for s in seqs], prefills=[])
    drafts = attach_drafts(spec, Scheduler(), plan)
    clock.now += base + per_row * (len(seqs) + sum(map(len, drafts.values())))
    for seq, draft in drafts.items():
        logits = torch.zeros(len(draft) + 1, VOCAB)
        logits[:, 5] = 1.0
        spec.verify(seq, logits, draft)
    spec.after_update({})
    return drafts


def test_the_timed_window_covers_drafting(clock):
    spec, proposer = _speculator(clock, draft_seconds=0.15)
    seqs = [Seq(0, SamplingParams()), Seq(1, SamplingParams())]
    drafts = _step(spec, clock, seqs, base=0.1, per_row=0.0)
    assert proposer.calls == 1 and [len(drafts[s]) for s in seqs] == [4, 4]   # the server's k, tried first
    arm = spec.fixed_policy.arms[(batch_bucket(2), StepSetting(4))]
    assert arm.seconds == pytest.approx(0.4) and arm.tokens == 10   # drafting and the pass; 4 accepted + 1 each


def test_server_k_turned_off_where_drafts_do_not_pay_and_no_drafting_is_done(clock):
    """At batch 32 every verified row costs a decoded one's share and drafting costs besides:
    plain decoding wins and its steps call no proposer. At batch 1, where rows are nearly free,
    the same drafts pay and stay on; a single decode drafts as configured, untimed."""
    spec, proposer = _speculator(clock, draft_seconds=0.003)
    large = [Seq(i, SamplingParams()) for i in range(32)]
    chosen = []
    for _ in range(200):
        calls = proposer.calls
        drafts = _step(spec, clock, large, base=0.0, per_row=0.004)
        chosen.append(bool(drafts))
        assert proposer.calls == calls + bool(drafts)   # no drafting work on a step that decodes plainly
    assert sum(chosen[-150:]) <= 0.1 * 150      # exploring steps only
    small = [Seq(99, SamplingParams()), Seq(98, SamplingParams())]
    on = [bool(_step(spec, clock, small, base=0.02, per_row=0.001)) for _ in range(200)]
    assert sum(on[-150:]) >= 0.85 * 150      # all but exploring steps
    table = spec.fixed_policy.table()
    assert table[32]["0"] > table[32]["4"] and table[2]["4"] > table[2]["0"]
    assert all(_step(spec, clock, [Seq(97, SamplingParams())], base=0.02, per_row=0.001) for _ in range(20))
    assert 1 not in spec.fixed_policy.table()


def test_own_k_and_sampled_requests_keep_theirs_when_the_server_k_is_off(clock):
    spec, _ = _speculator(clock, draft_seconds=0.2)
    policy = spec.fixed_policy
    policy.explore = 0.0
    bucket = batch_bucket(32)
    for setting, rate in ((StepSetting(0), 300.0), (StepSetting(4), 200.0)):   # measured: plain decoding wins
        policy.arms[(bucket, setting)] = step_policy.Arm(tokens=rate, seconds=1.0, samples=policy.TRIES)
    greedy = [Seq(i, SamplingParams()) for i in range(30)]
    own, sampled = Seq(200, SamplingParams(num_speculative_tokens=2)), Seq(201, SamplingParams(temperature=0.8, seed=1))
    plan = SimpleNamespace(decodes=[SimpleNamespace(seq=s) for s in [*greedy, own, sampled]], prefills=[])
    assert spec.lookaheads(plan) == [0] * 30 + [2, 4]


def test_the_deterministic_mode_drafts_the_server_k_as_configured(clock):
    spec, proposer = _speculator(clock, draft_seconds=0.003, deterministic=True)
    large = [Seq(i, SamplingParams()) for i in range(32)]
    assert all(_step(spec, clock, large, base=0.0, per_row=0.004) for _ in range(30))
    assert spec.fixed_policy is None and proposer.calls == 30


def test_auto_requests_are_capped_by_their_own_policy(clock):
    spec, _ = _speculator(clock, draft_seconds=0.0, k="auto")
    assert spec.fixed_policy is None
    plan = SimpleNamespace(decodes=[SimpleNamespace(seq=Seq(0, SamplingParams()))], prefills=[])
    assert spec.lookaheads(plan) == [0]        # the climb starts at plain decoding
    assert spec.step_policy._open is not None  # and times the step


def test_without_the_setting_the_server_k_drafts_as_configured(clock):
    """--spec-fixed-k-policy is opt-in: off, a large batch still drafts the server's k every step."""
    spec, proposer = _speculator(clock, draft_seconds=0.003, policy=False)
    large = [Seq(i, SamplingParams()) for i in range(32)]
    assert all(_step(spec, clock, large, base=0.0, per_row=0.004) for _ in range(30))
    assert spec.fixed_policy is None and proposer.calls == 30
