"""n-gram (prompt lookup) proposer: model-free drafts from the request's own history.

If the last n tokens (n from `max_n` down to `min_n`) occurred earlier in the prompt or output,
propose the tokens that followed that earlier occurrence (the most recent one), up to k. Code and
chat are full of such repeats (identifiers, boilerplate), and a wrong guess only costs a slot in
the verification pass.
"""
from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k proposed continuations of `tokens` (empty when no suffix repeats)."""
        if k <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = list(tokens[size - n:])
            # Most recent earlier occurrence of the suffix whose continuation is known.
            for start in range(size - n - 1, -1, -1):
                if list(tokens[start:start + n]) == suffix:
                    follow = list(tokens[start + n:start + n + k])
                    if follow:
                        return follow
        return []
