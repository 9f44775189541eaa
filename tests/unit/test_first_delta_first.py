"""A handed-on request's first delta (the prefill worker's) and the decode worker's come over two
connections: the router passes them on in stream order whichever it reads first."""
from __future__ import annotations

from cluster.token_stream import StreamBroken
from cluster.types import TokenDelta
from router.merging import FirstDeltaFirst


def _delta(rid: str, tokens: tuple[int, ...], total: int) -> TokenDelta:
    return TokenDelta(rid, tokens, "", num_output_tokens=total)


def test_decode_deltas_that_overtake_the_first_wait_for_it():
    order = FirstDeltaFirst()
    assert order.arrange([_delta("a", (70,), 2), _delta("a", (283, 153), 4)]) == []
    broken = StreamBroken("x")
    assert order.arrange([broken]) == [broken]                  # errors are never held
    out = order.arrange([_delta("b", (5,), 1), _delta("a", (80,), 1), _delta("a", (367,), 5)])
    assert [d.token_ids for d in out] == [(5,), (80,), (70,), (283, 153), (367,)]
    assert [d.token_ids for d in order.arrange([_delta("a", (9,), 6)])] == [(9,)]


def test_in_order_deltas_pass_at_once_forks_each_on_their_own():
    order = FirstDeltaFirst()
    out = order.arrange([_delta("a", (1,), 1), _delta("f", (2,), 1), _delta("a", (3,), 2), _delta("f", (4,), 2)])
    assert [d.token_ids for d in out] == [(1,), (2,), (3,), (4,)]
