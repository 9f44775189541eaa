"""The decode worker's side of training data: for opted-in tenants, the tokens each served request
computed here and the head's input features at those positions (taken from the pass the head makes
over the target's tokens anyway, `EagleFeatures.keep`: no extra forward). Kept in memory only, in a
bounded buffer per tenant (oldest samples dropped first), until the trainer takes them; never mixed
across tenants.

Only positions whose next token the target chose are kept: from the prompt's last position on
(colocated), from the first generated token on under P/D, where the prompt is the prefill worker's.
Labels are then always the target's own tokens, what a draft head must predict; prompt text is the
prompt author's.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from cluster.config import SpeculativeConfig
from cluster.engine.sequence import Sequence
from decode.spec.online.messages import ServedSample

MIN_SAMPLE_TOKENS = 8    # shorter stretches teach a multi-step head next to nothing


@dataclass
class _Open:
    """A running request's captured stretch (positions first_pos.. contiguous)."""
    first_pos: int
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def next_pos(self) -> int:
        return self.first_pos + len(self.tokens)


class OnlineCapture:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._tenants = config.online_tenants()    # parsed once: asked per sequence per step
        self._open: dict[Sequence, _Open] = {}
        self._ended: list[Sequence] = []
        self._buffers: dict[str, deque[ServedSample]] = {}
        self._buffered: dict[str, int] = {}      # tenant -> tokens held

    def wants(self, seq: Sequence) -> bool:
        return self._tenants is None or seq.tenant in self._tenants

    def add(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """Positions start.. of `seq` were computed and kept, with these features (one row each).
        Only positions whose next token the target chose are kept (from the prompt's last on): a
        head learns to draft the target's tokens, not the prompt's author's."""
        first = seq.num_prompt_tokens - 1
        if start < first:
            features = features[first - start:]
            start = first
        if features.shape[0] == 0:
            return
        entry = self._open.get(seq)
        if entry is None or entry.next_pos != start:
            # New, or not contiguous (a preempted request recomputed): start a fresh stretch.
            self._finish(seq)
            entry = self._open[seq] = _Open(start)
        n = features.shape[0]
        entry.tokens.extend(seq.token_ids[start:start + n])
        entry.rows.append(features.detach().to("cpu", copy=True))

    def release(self, seq: Sequence) -> None:
        """The request ended. Its stretch joins its tenant's buffer at the end of the step
        (`end_step`): the engine releases a request before its last step's rows are kept."""
        self._ended.append(seq)

    def end_step(self) -> None:
        for seq in self._ended:
            self._finish(seq)
        self._ended.clear()

    def _finish(self, seq: Sequence) -> None:
        entry = self._open.pop(seq, None)
        if entry is None or len(entry.tokens) < MIN_SAMPLE_TOKENS:
            return
        sample = ServedSample(seq.tenant, tuple(entry.tokens), torch.cat(entry.rows), entry.first_pos)
        buffer = self._buffers.setdefault(seq.tenant, deque())
        buffer.append(sample)
        held = self._buffered.get(seq.tenant, 0) + len(sample.tokens)
        while held > self.config.spec_online_buffer_tokens and len(buffer) > 1:
            held -= len(buffer.popleft().tokens)
        self._buffered[seq.tenant] = held

    def take(self) -> tuple[ServedSample, ...]:
        """Every buffered sample, handed to the trainer (and forgotten here)."""
        self.end_step()     # requests that ended after the last step (an idle engine makes no more)
        out = tuple(s for buffer in self._buffers.values() for s in buffer)
        self._buffers.clear()
        self._buffered.clear()
        return out

    def buffered_tokens(self) -> int:
        return sum(self._buffered.values())
