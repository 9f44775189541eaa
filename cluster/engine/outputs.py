"""The engine's live requests and the deltas they produce: each request's record, its
incremental detokenizer (stop strings end a request here), and the `TokenDelta` of each step."""
from __future__ import annotations

from collections.abc import Callable

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import Sequence
from cluster.types import FinishReason, TokenDelta


class Requests:
    def __init__(self, tokenizer, scheduler: Scheduler, on_finish: Callable[[Sequence], None]):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self.pending: list[TokenDelta] = []   # deltas made outside a step (aborts), sent by the next one
        self.on_finish = on_finish   # the speculator forgets the request

    def add(self, seq: Sequence) -> Sequence:
        self.seqs[seq.request_id] = seq
        self.detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, list(seq.prompt_token_ids),
                                                            seq.sampling.stop)
        return seq

    def check_free(self, request_ids: list[str]) -> None:
        in_use = [r for r in request_ids if r in self.seqs]
        if in_use or len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_id {(in_use or request_ids)[0]!r} is already in use")

    def ended(self, seq: Sequence) -> TokenDelta | None:
        """The last delta of a request the scheduler ended itself (the pool cannot hold it)."""
        if seq.request_id not in self.detok:
            return None
        return self.finish(seq, (), self.detok[seq.request_id].add((), final=True))

    def delta(self, seq: Sequence, tokens: list[int]) -> TokenDelta:
        detok = self.detok[seq.request_id]
        finished = seq.is_finished
        text = ""
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            # A P/D producer's request ends after its first token but the text goes on elsewhere: no
            # flush, so it emits exactly what a single engine would for that token.
            text += detok.add((token,), final=finished and last and not seq.hold_kv)
            if detok.stopped:
                if not last:   # a stop string inside an accepted draft: the tokens after it never happened
                    del seq.token_ids[len(seq.token_ids) - (len(tokens) - i - 1):]
                    tokens = tokens[:i + 1]
                    if finished:
                        seq.finish_reason = FinishReason.STOP
                if not finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    finished = True
                break
        logprobs = ()
        if seq.sampling.logprobs is not None and seq.logprobs:
            del seq.logprobs[seq.num_output_tokens:]
            logprobs = tuple(seq.logprobs[-len(tokens):])
        if finished:
            return self.finish(seq, tuple(tokens), text, logprobs)
        return TokenDelta(seq.request_id, tuple(tokens), text, None, logprobs, seq.num_prompt_tokens,
                          seq.num_output_tokens, seq.num_cached_tokens, seq.take_prompt_logprobs())

    def finish(self, seq: Sequence, token_ids, text: str, logprobs=()) -> TokenDelta:
        """A finished request's last delta; it is forgotten here."""
        for fork in seq.forks:   # it ended before its first sampling: so do the forks waiting on it
            self.scheduler.finish(fork, seq.finish_reason)
            self.pending.append(self.finish(fork, (), ""))
        seq.forks = []
        if self.on_finish is not None:
            self.on_finish(seq)
        self.seqs.pop(seq.request_id, None)
        self.detok.pop(seq.request_id, None)
        return TokenDelta(seq.request_id, tuple(token_ids), text, seq.finish_reason, tuple(logprobs),
                          seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens,
                          seq.take_prompt_logprobs())
