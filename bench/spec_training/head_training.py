"""What the draft heads' CPU trainers share (train_eagle3.py, train_block.py): the draft
vocabulary, AdamW without decay on norms and vectors, linear warmup then cosine to 10%, a clipped
step, the summary."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch


def draft_vocab(labels: torch.Tensor, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent target tokens among `labels` (sorted by id) and the share of
    labels they cover."""
    counts = torch.bincount(labels.flatten(), minlength=vocab_size)
    top = counts.topk(size).indices.sort().values
    return top, float(counts[top].sum() / counts.sum())


def head_optimizer(module: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    params = list(module.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def set_lr(opt: torch.optim.Optimizer, step: int, total: int, lr: float, warmup: int) -> None:
    value = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
    for group in opt.param_groups:
        group["lr"] = value


def clipped_step(loss: torch.Tensor, module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def write_summary(out_dir: Path, steps: int, t0: float, held_out, args) -> None:
    summary = {"steps": steps, "wall_s": round(time.time() - t0, 1), "held_out": held_out,
               "args": {k: str(v) for k, v in vars(args).items()}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)
