"""The stop-string automaton against a brute-force reading of the same rule, on random texts fed in
random pieces: the first stop string to complete (the longest of those completing at that
character) cuts the text, and what is held back is the longest tail that begins a stop string."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.stop_matcher import StopMatcher

ALPHABET = "abc"        # a small alphabet makes overlaps, shared prefixes and failure chains common


def _first_stop(text: str, stops) -> int:
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return end - max(map(len, done))
    return -1


def _held_back(text: str, stops) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=6),
       text=st.text(ALPHABET, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6))
def test_matches_the_brute_force_rule(stops, text, cuts):
    m = StopMatcher(stops)
    found = -1
    for end in sorted({*cuts, len(text)}):
        piece = text[:min(end, len(text))]
        found = m.feed(piece)
        if found >= 0:
            break
        assert m.held_back == _held_back(piece, stops)
    assert found == _first_stop(text, stops)


def test_many_stop_strings_and_only_new_text_is_read():
    """5,000 stop strings sharing prefixes; the text is fed as it grows, and each call reads only
    what was added since the last (the automaton keeps its state between calls)."""
    many = [f"zz{i:05d}" + "q" * 20 for i in range(5000)]
    m = StopMatcher(many)
    text = "zz0001" * 200
    assert m.feed(text) == -1 and m.held_back == len("zz0001")
    assert m.feed(text) == -1 and m.held_back == len("zz0001")     # nothing new: nothing changes
    assert m.feed(text + "2" + "q" * 19) == -1 and m.held_back == 26
    assert m.feed(text + "2" + "q" * 20) == len(text) - 6
    assert StopMatcher(["needle"]).feed("hay " * 50 + "needle and more") == 200
