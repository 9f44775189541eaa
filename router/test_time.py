"""Test-time compute for one prompt: its samples run as forks over one prompt KV (`Router.generate`
with forks, as OpenAI's `n`: the prompt is computed once, through P/D and speculation alike), then
one is chosen by a majority vote on extracted answers or by a score (router/test_time_policy.py).

With early stop the samples run in two waves: the first `MIN_VOTES` forks, then (only if their
vote is still open) the rest, forks again, whose prompt the decode worker holds in its prefix
cache by then (routing is prefix-affine). A wave stops as soon as the vote is decided: closing
its stream aborts the samples still running on every worker, which frees their blocks. Every
token streamed counts in the usage, those of samples cut short included.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from cluster.types import FinishReason, GenerateRequest, TokenDelta, TokenLogprob
from router.test_time_policy import (
    Strategy,
    TestTimeSpec,
    best_of,
    decided,
    extract_answer,
    majority,
    mean_logprob,
    vote_shares,
)


@dataclass(frozen=True)
class Candidate:
    """One sample, finished or cut short."""
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason          # ABORT: cut short by early stop
    answer: str | None                   # what it voted for (None: no match, or cut short)
    score: float


@dataclass(frozen=True)
class TestTimeOutcome:
    __test__ = False                     # not a pytest class
    candidates: tuple[Candidate, ...]    # in the order they finished, those cut short last
    chosen: int
    stopped_early: bool
    samples_run: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def completion_tokens(self) -> int:
        """Every token the samples generated (as streamed), those cut short included."""
        return sum(len(c.token_ids) for c in self.candidates)

    @property
    def best(self) -> Candidate:
        return self.candidates[self.chosen]


def sample_requests(req: GenerateRequest, spec: TestTimeSpec) -> tuple[GenerateRequest, ...]:
    """`req` and its samples: ids `<id>`, `<id>/tt1`, ...; with a seed, sample j gets seed + j (as
    `n` does); best_of's scorer reads each token's logprob, asked for when the client did not."""
    sampling = req.sampling
    if spec.needs_logprobs and sampling.logprobs is None:
        sampling = replace(sampling, logprobs=0)
    out = []
    for j in range(spec.samples):
        seed = None if sampling.seed is None else (sampling.seed + j) % 2**63
        rid = req.request_id if j == 0 else f"{req.request_id}/tt{j}"
        out.append(replace(req, request_id=rid, sampling=replace(sampling, seed=seed)))
    return tuple(out)


class _Sample:
    __slots__ = ("finish_reason", "logprobs", "text", "token_ids")

    def __init__(self):
        self.text, self.token_ids, self.logprobs, self.finish_reason = "", [], [], None


class _Run:
    """The samples' state while they run; the one place the vote is taken."""

    def __init__(self, spec: TestTimeSpec, observe: Callable[[TokenDelta], None] | None):
        self.spec = spec
        self.observe = observe
        self.samples: dict[str, _Sample] = {}
        self.finished: list[str] = []        # request ids, in the order they finished
        self.answers: list[str | None] = []  # theirs, in that order
        self.prompt_tokens = self.cached_tokens = 0
        self.stopped_early = False
        self.aborted = False

    async def wave(self, router, wave: tuple[GenerateRequest, ...]) -> None:
        """Run these samples together (forks of the first); stop them once the vote is decided."""
        for r in wave:
            self.samples[r.request_id] = _Sample()
        stream = router.generate(wave[0], wave[1:])
        try:
            async for d in stream:
                if d.finish_reason is FinishReason.ABORT:    # the client's Abort (of the first sample's id)
                    self.aborted = True
                    return
                if self._add(d) and self.spec.early_stop and decided(self.answers, self.spec.samples):
                    self.stopped_early = len(self.finished) < len(self.samples) or \
                        len(self.samples) < self.spec.samples
                    return
        finally:
            await stream.aclose()            # aborts, everywhere, the samples still running

    def _add(self, d: TokenDelta) -> bool:
        """One delta in; True when it finished its sample."""
        if self.observe is not None:
            self.observe(d)
        s = self.samples[d.request_id]
        s.text += d.text
        s.token_ids.extend(d.token_ids)
        s.logprobs.extend(d.logprobs)
        self.prompt_tokens = d.num_prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, d.num_cached_tokens)
        if d.finish_reason is None:
            return False
        s.finish_reason = d.finish_reason
        self.finished.append(d.request_id)
        self.answers.append(extract_answer(s.text, self.spec.answer_pattern))
        return True

    @property
    def open(self) -> bool:
        return not (self.stopped_early or self.aborted)

    def outcome(self) -> TestTimeOutcome:
        ids = self.finished + [r for r in self.samples if r not in self.finished]
        answers = self.answers + [None] * (len(ids) - len(self.finished))
        if self.spec.strategy is Strategy.MAJORITY:
            scores = vote_shares(answers)
            chosen = majority(answers)
        else:
            scores = [mean_logprob([lp.logprob for lp in self.samples[r].logprobs]) for r in ids]
            chosen = best_of(scores[:len(self.finished)])
        cands = tuple(Candidate(s.text, tuple(s.token_ids), tuple(s.logprobs), s.finish_reason or FinishReason.ABORT,
                                a, score)
                      for s, a, score in ((self.samples[r], a, sc) for r, a, sc in zip(ids, answers, scores)))
        return TestTimeOutcome(cands, 0 if chosen is None else chosen, self.stopped_early, len(self.samples),
                               self.prompt_tokens, self.cached_tokens)


async def run_test_time(router, samples: tuple[GenerateRequest, ...], spec: TestTimeSpec,
                        observe: Callable[[TokenDelta], None] | None = None) -> TestTimeOutcome:
    """Run `samples` (`sample_requests`) on `router` and choose one. `observe`: called with every
    delta (the frontends' request metrics). Without an answer from any sample, the first to finish
    is chosen. A sample aborted by the client (`Abort` names the request's id, the first sample's)
    ends them all: the outcome holds what finished before."""
    run = _Run(spec, observe)
    first = spec.first_wave()
    await run.wave(router, samples[:first])
    if run.open and first < len(samples):
        await run.wave(router, samples[first:])
    return run.outcome()
