"""The offline trainers' losses (train_eagle3.py, train_block.py), over the serving modules of
decode/spec/heads: the EAGLE-3 head's per-pass CE through the training-time test, and the block
drafter's CE per block row. Labels are draft ids (decode/spec/online/objective.py
`target_to_draft`), -100 where ignored."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from decode.spec.heads.block import BlockDrafter, draft_logits
from decode.spec.heads.eagle import TargetParts
from decode.spec.heads.eagle3 import Eagle3Head
from decode.spec.online.objective import forward_unrolled


def unrolled_losses(head: Eagle3Head, tokens, feats3, labels, loss_mask, tp, passes: int):
    """Per-pass CE (mean over masked positions) and top-1 agreement; labels are draft ids."""
    f = head.fused(feats3)
    outs = forward_unrolled(head, tokens, f, tp, passes)
    losses, accs = [], []
    for s, g in enumerate(outs):
        mask = loss_mask.clone()
        mask[:, :s] = False
        logits = head.draft_logits(g[mask]).float()
        y = labels[mask]
        losses.append(F.cross_entropy(logits, y, ignore_index=-100))
        accs.append(float((logits.argmax(-1) == y).float().mean()))
    return losses, accs


def block_losses(drafter: BlockDrafter, tp: TargetParts, head_rows: torch.Tensor, first, feats3, ctx_len, pos,
                 labels, decay: float) -> tuple[torch.Tensor, list[float]]:
    """Weighted CE over the block rows (weight decay**i; labels are draft ids, -100 where absent or
    outside the draft vocabulary) and per-row top-1 agreement with the labels (the target's own
    greedy tokens)."""
    g = drafter(lambda ids: F.embedding(ids, tp.embed), first, drafter.fused(feats3), ctx_len, pos)
    logits = draft_logits(g, tp, head_rows).float()                        # [B, K, Vd]
    K = logits.shape[1]
    loss = logits.new_zeros(())
    accs = []
    for i in range(K):
        y = labels[:, i]
        keep = y >= 0
        if not keep.any():
            accs.append(0.0)
            continue
        loss = loss + decay ** i * F.cross_entropy(logits[keep, i], y[keep])
        accs.append(float((logits[keep, i].argmax(-1) == y[keep]).float().mean()))
    return loss, accs
