"""Test-time compute's policy (router/test_time_policy.py): answers, the vote, the score, early
stop and the request's validation; and the orchestration's waves (router/test_time.py) over a
scripted router (policy code: the served path is tests/e2e/test_test_time_cluster.py)."""
from __future__ import annotations

import asyncio
import math

import pytest

from cluster.types import (
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
)
from proto.splitserve.v1 import inference_pb2 as pb
from router.errors import ValidationError
from router.test_time import run_test_time, sample_requests
from router.test_time_policy import (
    Strategy,
    TestTimeSpec,
    best_of,
    decided,
    extract_answer,
    majority,
    mean_logprob,
    spec_from_proto,
    vote_shares,
)
from router.validation import RequestBounds


def test_extract_answer_takes_the_last_match_and_its_first_group():
    assert extract_answer("  42 \n") == "42"
    assert extract_answer("   ") is None
    assert extract_answer("3 + 4 = 7, so 7 apples, not 8", r"\d+") == "8"
    assert extract_answer("answer: 5 ... answer: 6.", r"answer: (\d+)") == "6"
    assert extract_answer("no digits here", r"\d+") is None
    assert extract_answer("x", r"(y)?x") is None          # the group did not take part


def test_majority_votes_and_ties_go_to_the_answer_reached_first():
    assert majority(["4", "5", "4", None]) == 0
    assert majority([None, "5", "4", "4", "5"]) == 1        # 2-2: "5" was reached first
    assert majority([None, "7"]) == 1
    assert majority([None, None]) is None
    assert vote_shares(["4", "5", "4", None]) == [2 / 3, 1 / 3, 2 / 3, 0.0]


def test_best_of_picks_the_highest_mean_logprob():
    scores = [mean_logprob([-1.0, -3.0]), mean_logprob([-0.5]), mean_logprob([])]
    assert scores[:2] == [-2.0, -0.5] and scores[2] == -math.inf
    assert best_of(scores) == 1
    assert best_of([-1.0, -1.0]) == 0
    assert best_of([]) is None


def test_early_stop_when_the_leader_cannot_be_overtaken_or_is_certain():
    assert decided(["4", "4"], 3)                  # 2 > 0 + 1 left
    assert not decided(["4", "5"], 3)
    assert decided(["4", "4", "4"], 16)           # certainty (3 + 1) / (3 + 2) = 0.8
    assert not decided(["4", "4", "5"], 16)
    assert not decided(["4", "4", None], 16)       # no answer, no vote
    assert not decided([None, None], 2)
    assert decided(["4", "5", "4", "4", "4", "4", "4", "4"], 16)    # 7 of 8: (7 + 1) / 10


def _msg(**kw) -> pb.TestTime:
    return pb.TestTime(**{"strategy": pb.TEST_TIME_STRATEGY_MAJORITY, "samples": 4, **kw})


def test_spec_validation_names_the_field():
    bounds = RequestBounds()
    spec = spec_from_proto(_msg(early_stop=True, answer_pattern=r"(\d+)"), bounds)
    assert spec == TestTimeSpec(Strategy.MAJORITY, 4, True, r"(\d+)", "logprob") and spec.first_wave() == 3
    cases = {"test_time.samples": _msg(samples=17), "test_time.strategy": _msg(strategy=0),
             "test_time.answer_pattern": _msg(answer_pattern="(unclosed"),
             "test_time.early_stop": _msg(strategy=pb.TEST_TIME_STRATEGY_BEST_OF, early_stop=True),
             "test_time.scorer": _msg(strategy=pb.TEST_TIME_STRATEGY_BEST_OF, scorer="other-model")}
    for field, msg in cases.items():
        with pytest.raises(ValidationError) as err:
            spec_from_proto(msg, bounds, ("served",))
        assert err.value.field == field, (field, str(err.value))
    assert "--max-test-time-samples" in str(pytest.raises(ValidationError, spec_from_proto, _msg(samples=0), bounds).value)
    assert spec_from_proto(_msg(samples=40), RequestBounds(max_test_time_samples=40)).samples == 40


class _ScriptedRouter:
    """Each sample streams its scripted text one token a step, all samples of a wave in lockstep."""

    def __init__(self, texts: list[str], abort_at: str | None = None):
        self.texts = texts
        self.abort_at = abort_at        # a text whose sample the client aborts (at its first token)
        self.started: list[str] = []
        self.closed_early = 0

    async def generate(self, req, forks=()):
        members = (req, *forks)
        self.started += [m.request_id for m in members]
        words = {m.request_id: self.texts[self._index(m.request_id)].split(" ") for m in members}
        done = 0
        try:
            for step in range(max(len(w) for w in words.values())):
                for rid, w in words.items():
                    if step < len(w):
                        if self.abort_at == " ".join(w):
                            yield TokenDelta(rid, (), "", FinishReason.ABORT)
                            continue
                        end = step == len(w) - 1
                        yield TokenDelta(rid, (step,), w[step] + ("" if end else " "),
                                         FinishReason.STOP if end else None, (TokenLogprob(step, -0.1 * len(w)),),
                                         num_prompt_tokens=5)
                        done += end
                await asyncio.sleep(0)
        finally:
            self.closed_early += done < len(members)

    @staticmethod
    def _index(rid: str) -> int:
        return int(rid.rsplit("/tt", 1)[1]) if "/tt" in rid else 0


def _run(texts, spec, abort_at=None):
    router = _ScriptedRouter(texts, abort_at)
    req = GenerateRequest("r", (1, 2, 3), SamplingParams(seed=7))
    samples = sample_requests(req, spec)
    assert [s.sampling.seed for s in samples] == [7 + j for j in range(spec.samples)]
    return router, asyncio.run(run_test_time(router, samples, spec))


def test_waves_stop_once_the_vote_is_certain_and_count_every_token():
    spec = TestTimeSpec(Strategy.MAJORITY, 6, early_stop=True, answer_pattern=r"(\d+)")
    router, out = _run(["it is 4", "4", "so 4 it is", "5", "5", "5"], spec)
    assert router.started == ["r", "r/tt1", "r/tt2"] and out.samples_run == 3 and out.stopped_early
    assert [c.answer for c in out.candidates] == ["4", "4", "4"] and out.best.text == "4"   # the first to finish
    assert out.completion_tokens == 3 + 1 + 4
    # Without early stop every sample runs, and the majority wins.
    router, out = _run(["4", "4", "5", "5", "5", "x"], TestTimeSpec(Strategy.MAJORITY, 6, answer_pattern=r"\d"))
    assert out.samples_run == 6 and not out.stopped_early and out.best.answer == "5"
    assert out.completion_tokens == 6


def test_a_decided_wave_cuts_the_slow_samples_short():
    spec = TestTimeSpec(Strategy.MAJORITY, 3, early_stop=True, answer_pattern=r"\d+")
    router, out = _run(["so 7", "it is 7", "a long way to seven"], spec)
    assert out.stopped_early and router.closed_early == 1
    assert out.candidates[2].finish_reason is FinishReason.ABORT and out.candidates[2].answer is None
    assert out.completion_tokens == 2 + 3 + 2          # the cut sample's two tokens count


def test_the_second_wave_runs_when_the_first_disagrees():
    spec = TestTimeSpec(Strategy.MAJORITY, 5, early_stop=True)
    router, out = _run(["1", "2", "3", "2", "2"], spec)
    assert router.started == ["r", "r/tt1", "r/tt2", "r/tt3", "r/tt4"] and out.best.answer == "2"


def test_best_of_chooses_the_highest_mean_logprob():
    spec = TestTimeSpec(Strategy.BEST_OF, 3)
    _, out = _run(["a b c", "d", "e f"], spec)
    assert out.best.text == "d" and out.best.score == pytest.approx(-0.1)
    assert sample_requests(GenerateRequest("r", (1,), SamplingParams()), spec)[1].sampling.logprobs == 0


def test_a_client_abort_of_one_sample_ends_them_all():
    spec = TestTimeSpec(Strategy.MAJORITY, 5, early_stop=True)
    router, out = _run(["a", "b c d", "e f g h"], spec, abort_at="e f g h")
    assert router.started == ["r", "r/tt1", "r/tt2"] and router.closed_early == 1
    assert out.best.text == "a" and out.samples_run == 3 and out.completion_tokens == 1 + 1
