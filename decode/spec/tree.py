"""Token trees from a chain drafter: the runner-up token beside the draft's least certain ones.

A chain draft's token at depth d is worth something only if every token before it is accepted;
when the target disagrees at d, the step still gets the target's own token there, so a sibling
leaf carrying the draft's runner-up at d adds exactly one token, with chance about
reach(d) * p2(d): the draft's top probabilities up to d times its runner-up's. Each leaf costs one
verified row. So, per step, leaves go where that expected gain is highest across the whole batch,
at most `budget` of them and none below `min_gain`, each within its sequence's reserved room.
Leaves have no children (the drafter never ran past them), which keeps the draft's own passes
chains; the target verifies the tree in one pass (cluster/engine/draft_tree.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.engine.speculation import Draft


@dataclass(frozen=True)
class Alternative:
    token: int        # the draft's runner-up at this depth
    prob: float       # its probability under the draft


def wants_leaves(sizes: list[int], ks: list[int]) -> list[bool]:
    """Which sequences may grow leaves: those given room past their chain (sizes[i] > ks[i])."""
    return [n > k for n, k in zip(sizes, ks)]


def grow(drafts: list[Draft], alternatives: list[list[Alternative]], sizes: list[int], ks: list[int], budget: int,
         min_gain: float) -> list[Draft]:
    """`add_leaves` within each sequence's room: sizes[i] tokens in all where sizes[i] > ks[i]
    (a chain cut short leaves more), none otherwise (a request whose sampling needs a chain)."""
    rooms = [n - len(d) if grows else 0 for n, d, grows in zip(sizes, drafts, wants_leaves(sizes, ks))]
    return add_leaves(drafts, alternatives, rooms, budget, min_gain)


def add_leaves(drafts: list[Draft], alternatives: list[list[Alternative]], rooms: list[int], budget: int,
               min_gain: float) -> list[Draft]:
    """drafts[i] (a chain with its top probabilities) gains up to rooms[i] sibling leaves, the
    batch at most `budget`; alternatives[i][d] is the runner-up beside drafts[i].tokens[d]."""
    candidates = []
    for i, (draft, alts) in enumerate(zip(drafts, alternatives)):
        reach = 1.0
        for depth, (tok, alt) in enumerate(zip(draft.tokens, alts)):
            gain = reach * alt.prob
            if gain >= min_gain and alt.token != tok:
                candidates.append((gain, i, depth, alt.token))
            reach *= draft.confidences[depth] if depth < len(draft.confidences) else 1.0
    candidates.sort(key=lambda c: -c[0])
    chosen: list[list[tuple[int, int]]] = [[] for _ in drafts]
    for _, i, depth, tok in candidates:
        if budget <= 0:
            break
        if len(chosen[i]) < rooms[i]:
            chosen[i].append((depth, tok))
            budget -= 1
    return [_with_leaves(d, leaves) if leaves else d for d, leaves in zip(drafts, chosen)]


def _with_leaves(draft: Draft, leaves: list[tuple[int, int]]) -> Draft:
    n = len(draft.tokens)
    leaves.sort()
    parents = (*range(-1, n - 1), *(depth - 1 for depth, _ in leaves))
    return replace(draft, tokens=(*draft.tokens, *(tok for _, tok in leaves)), parents=parents)
