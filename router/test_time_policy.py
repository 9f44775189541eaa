"""Test-time compute's policy, as plain functions: what a request's `test_time` asks for
(`TestTimeSpec`, validated from its proto), the answer a sample votes for, the majority vote, the
best-of score, and when early stop may end the sampling. `router/test_time.py` runs the samples.

Early stop (majority only) is Dynasor-like (certainty from the agreement of the samples so far,
not from probing a sample's hidden answer): the vote stops once the leading answer cannot be
overtaken by the samples still to finish, or once at least `MIN_VOTES` samples voted and the
leader's Laplace-smoothed share, (votes + 1) / (voters + 2), reaches `CERTAINTY` (three unanimous
votes: 0.8). Samples that produced no answer never vote.
"""
from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from router.errors import ValidationError
from router.validation import RequestBounds, clip

MIN_VOTES = 3            # early stop's first wave, and the fewest votes the certainty rule trusts
CERTAINTY = 0.8          # the leader's smoothed share of the votes that ends the sampling
MAX_PATTERN_CHARS = 256  # a client's regex runs on every sample's text: kept short
LOGPROB_SCORER = "logprob"


class Strategy(enum.Enum):
    MAJORITY = "majority"
    BEST_OF = "best_of"


@dataclass(frozen=True)
class TestTimeSpec:
    """A request's test-time compute, validated."""
    __test__ = False                         # not a pytest class
    strategy: Strategy
    samples: int
    early_stop: bool = False
    answer_pattern: str = ""                 # "": the whole (stripped) text is the answer
    scorer: str = LOGPROB_SCORER

    @property
    def needs_logprobs(self) -> bool:
        return self.strategy is Strategy.BEST_OF

    def first_wave(self) -> int:
        """Samples started at once: all of them, or with early stop the first `MIN_VOTES` (the
        rest start, as one more wave over the cached prompt, only if those leave the vote open)."""
        return min(self.samples, MIN_VOTES) if self.early_stop else self.samples


_STRATEGIES = {1: Strategy.MAJORITY, 2: Strategy.BEST_OF}


def spec_from_proto(msg, bounds: RequestBounds, served: tuple[str, ...] = ()) -> TestTimeSpec:
    """A `splitserve.v1.TestTime` checked against the bounds; ValidationError names the field
    (`test_time.samples`, ...). `served`: the served models' names (a scorer naming one is
    refused while this server serves only one model: nothing else could score)."""
    strategy = _STRATEGIES.get(msg.strategy)
    if strategy is None:
        raise ValidationError("test_time.strategy", "expected \"majority\" or \"best_of\"")
    limit = min(bounds.max_test_time_samples, bounds.max_n, bounds.max_samples_per_request)
    if not 1 <= msg.samples <= limit:
        raise ValidationError("test_time.samples", f"must be in [1, {limit}] (--max-test-time-samples, --max-n, "
                                                   f"--max-samples-per-request), got {msg.samples}")
    if msg.early_stop and strategy is not Strategy.MAJORITY:
        raise ValidationError("test_time.early_stop", "applies to strategy \"majority\" only")
    check_pattern(msg.answer_pattern)
    scorer = msg.scorer or LOGPROB_SCORER
    if scorer != LOGPROB_SCORER:
        if strategy is not Strategy.BEST_OF:
            raise ValidationError("test_time.scorer", "applies to strategy \"best_of\" only")
        others = [m for m in served if m != scorer]
        raise ValidationError("test_time.scorer", f"{clip(scorer)}: scoring by another served model needs a second "
                                                  f"model; this server serves only {', '.join(others) or 'one'}: "
                                                  f"use \"{LOGPROB_SCORER}\"")
    return TestTimeSpec(strategy, msg.samples, msg.early_stop, msg.answer_pattern, scorer)


def check_pattern(pattern: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValidationError("test_time.answer_pattern", f"at most {MAX_PATTERN_CHARS} characters, "
                                                          f"got {len(pattern)}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValidationError("test_time.answer_pattern", f"is not a valid regular expression: {exc}") from None


def extract_answer(text: str, pattern: str = "") -> str | None:
    """The answer a sample votes for: the pattern's last match in `text` (its first group if it
    has groups), stripped; the whole text, stripped, without a pattern. None: no answer."""
    if not pattern:
        answer = text.strip()
        return answer or None
    last = None
    for last in re.finditer(pattern, text):
        pass
    if last is None:
        return None
    found = last.group(1) if last.re.groups else last.group(0)
    return found.strip() if found is not None and found.strip() else None


def tally(answers: Sequence[str | None]) -> dict[str, int]:
    """Votes per answer, in the order each answer was first reached (None does not vote)."""
    votes: dict[str, int] = {}
    for a in answers:
        if a is not None:
            votes[a] = votes.get(a, 0) + 1
    return votes


def majority(answers: Sequence[str | None]) -> int | None:
    """The index of the first sample whose answer has the most votes (a tie goes to the answer
    reached first); None when no sample has an answer."""
    votes = tally(answers)
    if not votes:
        return None
    best = max(votes.values())
    winner = next(a for a, v in votes.items() if v == best)      # dicts keep first-reached order
    return answers.index(winner)


def mean_logprob(logprobs: Sequence[float]) -> float:
    """best_of's "logprob" scorer: the sample's mean token logprob (-inf for an empty sample)."""
    return sum(logprobs) / len(logprobs) if logprobs else -math.inf


def best_of(scores: Sequence[float]) -> int | None:
    """The index of the highest score (the first among equals); None for no samples."""
    if not scores:
        return None
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def vote_shares(answers: Sequence[str | None]) -> list[float]:
    """Each sample's score under majority: its answer's share of the votes (0 without an answer)."""
    votes = tally(answers)
    voters = sum(votes.values())
    return [votes[a] / voters if a is not None else 0.0 for a in answers]


def decided(answers: Sequence[str | None], samples: int) -> bool:
    """Early stop: `answers` are the finished samples' (None: no answer) out of `samples` in all;
    True once the leader cannot be overtaken by the rest, or is certain enough (module doc)."""
    votes = sorted(tally(answers).values(), reverse=True)
    if not votes:
        return False
    leader, second = votes[0], (votes[1] if len(votes) > 1 else 0)
    remaining = samples - len(answers)
    if leader > second + remaining:
        return True
    voters = sum(votes)
    return voters >= MIN_VOTES and (leader + 1) / (voters + 2) >= CERTAINTY
