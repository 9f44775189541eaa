"""Stop strings matched in time that does not grow with their number.

An Aho-Corasick automaton over the request's stop strings, built once when the request arrives:
each new character of output costs one transition (amortized), whatever the number of stop
strings. Its state is the longest tail of the text that is a prefix of some stop string, which is
exactly what must be held back from the client until it is known not to be a stop string.

The automaton is built in time and memory linear in the stop strings' total length, which the
front door bounds (`RequestBounds.max_stop_strings` x `max_stop_string_chars`), on the engine's
thread: it is immutable and cached by its stop strings, so a request's `n` samples, and requests
that repeat one set of stop strings, build it once. Each sample reads it with its own cursor.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache


class StopAutomaton:
    __slots__ = ("_goto", "_fail", "_depth", "_match")

    def __init__(self, stops: Sequence[str]):
        self._goto: dict[tuple[int, str], int] = {}   # (node, char) -> child: one flat dict, no dict per node
        self._depth = [0]
        terminal = [0]                                # length of the stop string ending at a node, or 0
        for s in stops:
            node = 0
            for ch in s:
                nxt = self._goto.get((node, ch))
                if nxt is None:
                    nxt = len(self._depth)
                    self._goto[(node, ch)] = nxt
                    self._depth.append(self._depth[node] + 1)
                    terminal.append(0)
                node = nxt
            terminal[node] = len(s)
        self._fail, self._match = self._links(terminal)

    def _links(self, terminal: list[int]) -> tuple[list[int], list[int]]:
        """Failure links (longest proper suffix that is also a trie node) and, per node, the
        longest stop string ending there (itself or through its failure chain)."""
        children: dict[int, list[tuple[str, int]]] = {}
        for (node, ch), child in self._goto.items():
            children.setdefault(node, []).append((ch, child))
        fail = [0] * len(self._depth)
        match = list(terminal)
        queue = deque(child for _, child in children.get(0, ()))
        while queue:
            node = queue.popleft()
            for ch, child in children.get(node, ()):
                f = fail[node]
                while f and (f, ch) not in self._goto:
                    f = fail[f]
                fail[child] = self._goto.get((f, ch), 0)
                match[child] = match[child] or match[fail[child]]
                queue.append(child)
        return fail, match

    def step(self, state: int, text: str, start: int) -> tuple[int, int]:
        """Read `text[start:]` from `state`: (state after it, -1), or at the first stop string that
        completes (that state, the index where the stop string starts)."""
        goto, fail, match = self._goto, self._fail, self._match
        for i in range(start, len(text)):
            ch = text[i]
            while state and (state, ch) not in goto:
                state = fail[state]
            state = goto.get((state, ch), 0)
            if match[state]:
                return state, i + 1 - match[state]
        return state, -1

    def depth(self, state: int) -> int:
        return self._depth[state]


@lru_cache(maxsize=16)
def automaton_for(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


class StopMatcher:
    """One sample's cursor over its request's automaton."""

    __slots__ = ("_automaton", "_state", "_seen")

    def __init__(self, stops: Sequence[str]):
        self._automaton = automaton_for(tuple(stops))
        self._state = 0
        self._seen = 0          # characters of the text fed so far

    def feed(self, text: str) -> int:
        """Feed the text so far (only what was added since the last call is read). Returns the
        index where the first stop string to complete starts, or -1; after a match it is spent."""
        self._state, cut = self._automaton.step(self._state, text, self._seen)
        self._seen = len(text)
        return cut

    @property
    def held_back(self) -> int:
        """Characters at the end of the text fed that may still become a stop string."""
        return self._automaton.depth(self._state)
