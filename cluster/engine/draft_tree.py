"""Token trees: several candidate continuations of one sequence verified in one target pass.

A draft is a tree over its k tokens: `parents[i]` is the index of token i's parent among the
draft's tokens, -1 for a child of the sequence's pending token (the root). Tokens come in
topological order (a parent before its children) and siblings differ, so the target's token
after any node picks at most one child. A chain is the tree (-1, 0, 1, ...) and is written ().

Where a tree lives in one pass: token i is computed at position start + depth(i) (its depth,
counting the root's children as 1) but written to slot start + 1 + i of the sequence's reserved
lookahead slots, and it attends the context, its ancestors and itself (the attention backends
read its ancestors' slots as the tail of its keys: kernels/rows.py `tree_tails`). After verification the accepted
path's K/V moves down to the slots its positions own (`compaction`), and everything past them is
rolled back like a rejected chain.
"""
from __future__ import annotations

import torch

from kernels.rows import tree_depths, tree_path


depths, path = tree_depths, tree_path   # kernels/rows.py's: the kernels lay out tree rows by them too


def check(tokens: tuple[int, ...], parents: tuple[int, ...]) -> None:
    """ValueError unless `parents` is a topologically ordered tree over `tokens` whose siblings differ."""
    if len(parents) != len(tokens):
        raise ValueError(f"a draft tree needs one parent per token: {len(parents)} for {len(tokens)} tokens")
    seen: set[tuple[int, int]] = set()
    for i, (tok, p) in enumerate(zip(tokens, parents)):
        if not -1 <= p < i:
            raise ValueError(f"draft tree node {i} has parent {p}: parents come first (-1 is the root)")
        if (p, tok) in seen:
            raise ValueError(f"draft tree node {i} repeats its sibling's token {tok}")
        seen.add((p, tok))


def children(tokens: tuple[int, ...], parents: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """(parent, token) -> node: the one child of a node that carries a token (siblings differ)."""
    return {(p, tok): i for i, (p, tok) in enumerate(zip(parents, tokens))}


def accepted_nodes(tokens: tuple[int, ...], parents: tuple[int, ...], accepted: list[int]) -> list[int]:
    """The nodes whose tokens `accepted` (the accepted draft tokens, in order) walked through."""
    child = children(tokens, parents)
    nodes, at = [], -1
    for tok in accepted:
        at = child[(at, tok)]
        nodes.append(at)
    return nodes


def compaction(start: int, nodes: list[int]) -> list[tuple[int, int]]:
    """(from, to) positions in the sequence, for accepted nodes not yet at their own position:
    node i was written at start + 1 + i, and the j-th accepted node's position is start + 1 + j.
    Each source lies at or past every later destination, so moving them in order is safe."""
    return [(start + 1 + node, start + 1 + j) for j, node in enumerate(nodes) if node != j]


def move_slots(arena: torch.Tensor, moves: list[tuple[int, int]]) -> None:
    """Copy each layer's K and V rows between flat slots of an arena [layers, 2, blocks, bs, ...]
    (quantized rows carry their scales along)."""
    if not moves:
        return
    flat = arena.view(arena.shape[0], 2, arena.shape[2] * arena.shape[3], *arena.shape[4:])
    src = torch.tensor([s for s, _ in moves], dtype=torch.long, device=arena.device)
    dst = torch.tensor([d for _, d in moves], dtype=torch.long, device=arena.device)
    flat[:, :, dst] = flat[:, :, src]
