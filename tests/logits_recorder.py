"""Records every logits row an engine computes, keyed by the exact tokens that led to it.

A row is the model's output at one position; the key is the whole token sequence up to and
including that position, so rows of the same context computed in different runs (alone, in a
batch, in a prefill chunk, as a decode row, inside a speculative verification, after a
preemption) meet under the same key, and rows computed for a rejected draft (another context)
never collide with the accepted ones.
"""
from __future__ import annotations

import torch


class LogitsRecorder:
    def __init__(self, engine):
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        self.verified = 0      # rows computed inside speculative verification spans
        self.preempted: set[tuple[int, ...]] = set()   # prompts of the requests preempted (recomputed later)
        self._runner = engine.runner
        self._execute = engine.runner.execute
        engine.runner.execute = self._record

    def _record(self, plan):
        out = self._execute(plan)
        logits = out.logits
        self.preempted.update(seq.prompt_token_ids for seq in plan.preempted)
        row = 0
        for chunk in plan.chunks:
            if not (chunk.draft or chunk.samples):
                continue
            tokens = chunk.seq.token_ids
            if chunk.draft:
                inputs = [tokens[chunk.start], *chunk.draft]
                self.verified += len(inputs)
                for j in range(len(inputs)):
                    self._put((*tokens[:chunk.start], *inputs[: j + 1]), logits[row + j])
                row += len(inputs)
            else:
                self._put(tuple(tokens[: chunk.start + chunk.num_tokens]), logits[row])
                row += 1
        assert row == logits.shape[0]
        return out

    def _put(self, key: tuple[int, ...], row: torch.Tensor) -> None:
        if key in self.rows:   # a row recorded twice (re-verified, recomputed) must agree bitwise
            assert torch.equal(self.rows[key], row), f"position {len(key) - 1} recomputed differently"
        self.rows[key] = row.clone()

    def compare(self, other: LogitsRecorder, tokens: list[int]) -> tuple[int, list[int]]:
        """Positions of `tokens` (a prompt and its completion) that both recorders computed:
        (how many were compared, the positions whose rows differ in any bit)."""
        compared, differ = 0, []
        for end in range(1, len(tokens) + 1):
            key = tuple(tokens[:end])
            if key in self.rows and key in other.rows:
                compared += 1
                if not torch.equal(self.rows[key], other.rows[key]):
                    differ.append(end - 1)
        return compared, differ
