"""Accepting proposed tokens after one target forward pass over k+1 positions.

Greedy: accept the longest prefix of the proposal that equals the target's argmax, then add the
target's own next token (so every step yields at least one token and greedy output is unchanged).

Sampling (Leviathan et al., Chen et al.): accept proposed token x with probability
min(1, p(x) / q(x)); at the first rejection, sample from the normalised residual max(0, p - q).
If all k are accepted, sample the bonus token from p at position k. The output is distributed
exactly as sampling from the target alone.
"""
from __future__ import annotations

import torch

from cluster.engine import draft_tree
from cluster.engine.sampler import ordered_sum


def accept_greedy(target_logits: torch.Tensor, proposal: list[int]) -> list[int]:
    """target_logits: [k+1, V] at the positions after each proposed prefix. Returns the tokens to
    append (accepted prefix + one target token)."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    out = []
    for i, tok in enumerate(proposal):
        if best[i] != tok:
            break
        out.append(tok)
    out.append(best[len(out)])
    return out


def accept_greedy_tree(target_logits: torch.Tensor, proposal: tuple[int, ...], parents: tuple[int, ...]) -> list[int]:
    """A token tree (cluster/engine/draft_tree.py): row 0 is the pending token's, row i + 1 draft
    i's. From the root, follow the child equal to the target's token at the current node while
    there is one; then add the target's own token. Returns the tokens to append."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    child = draft_tree.children(proposal, parents)
    out, at = [], -1
    while True:
        tok = best[at + 1]
        out.append(tok)
        at = child.get((at, tok), -2)
        if at == -2:
            return out


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, proposal: list[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """target_probs: [k+1, V] (already temperature/top-p warped), draft_probs: [k, V] (the
    distributions the proposal was drawn from). Returns the tokens to append."""
    out = []
    k = len(proposal)
    if k:
        # p, q and the uniforms of every proposed token in one host copy (one device sync, not 3 per token).
        rows = torch.arange(k, device=target_probs.device)
        index = torch.tensor(proposal, device=target_probs.device)
        u = torch.rand(k, generator=generator, device=target_probs.device)
        ps, qs, us = torch.stack([target_probs[rows, index], draft_probs[rows, index].to(u.dtype), u]).tolist()
        for i, tok in enumerate(proposal):
            p, q = ps[i], qs[i]
            if q > 0 and us[i] < min(1.0, p / q):
                out.append(tok)
                continue
            residual = torch.clamp(target_probs[i] - draft_probs[i], min=0)
            total = ordered_sum(residual)
            dist = torch.where(total > 0, residual / total, target_probs[i])
            out.append(int(torch.multinomial(dist, 1, generator=generator)))
            return out
    out.append(int(torch.multinomial(target_probs[len(proposal)], 1, generator=generator)))
    return out
