"""n-gram (prompt lookup) proposer: model-free drafts from the request's own history.

If the last n tokens (n from `max_n` down to `min_n`) occurred earlier in the prompt or output,
propose the tokens that followed that earlier occurrence (the most recent one), up to k. Code and
chat are full of such repeats (identifiers, boilerplate), and a wrong guess only costs a slot in
the verification pass.

`propose_tree` keeps the other earlier occurrences too: their continuations, merged into a token
tree (a trie) behind the most recent one's, are verified in the same pass (cluster/engine/
draft_tree.py), so a history that continued in several ways offers each of them.
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
        return next(self._continuations(tokens, k), [])

    def propose_tree(self, tokens: Sequence[int], k: int, size: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of a token tree of at most `size` nodes and depth k: the most recent
        occurrence's continuation first (what `propose` gives), then the others' merged in, most
        recent first, longest suffix first."""
        nodes: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        for follow in self._continuations(tokens, k):
            at = -1
            for tok in follow:
                child = children.get((at, tok))
                if child is None:
                    if len(nodes) >= size:
                        break
                    child = len(nodes)
                    nodes.append(tok)
                    parents.append(at)
                    children[(at, tok)] = child
                at = child
            if len(nodes) >= size:
                break
        return nodes, parents

    def _continuations(self, tokens: Sequence[int], k: int):
        """What followed each earlier occurrence of the history's last n tokens (up to k tokens),
        n from max_n down, most recent occurrence first."""
        if k <= 0:
            return
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = list(tokens[size - n:])
            last = suffix[-1]
            for start in range(size - n - 1, -1, -1):
                if tokens[start + n - 1] == last and list(tokens[start:start + n]) == suffix:
                    follow = list(tokens[start + n:start + n + k])
                    if follow:
                        yield follow
