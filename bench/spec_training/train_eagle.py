"""Train the EAGLE head (decode/spec/heads/eagle.py) for stdlib-coder on CPU.

Per step: the frozen target runs on a batch of training windows (bf16 autocast,
no grad); a forward hook on its last decoder layer gives the pre-norm features
f, and its logits give the soft targets p. The head is then run with
``forward_unrolled`` ("training-time test", decode/spec/online/objective.py): pass 0
sees true features, pass s sees its own pass s-1 outputs, exactly as at draft step
s + 1. Loss per pass:

    soft CE(p_target || softmax(lm_head(norm(g_s))))  +  reg * SmoothL1(g_s, f)   (unit-rms space)

weighted by ``pass_decay ** s``. The target's embedding, norm and lm_head stay
frozen (the head uses the target's own). Writes the checkpoint in the format of
eagle.save_eagle_head to --export (and ckpt.pt / log.jsonl to --out-dir).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from .data import WindowSampler, load_split
from decode.spec.heads.eagle import EagleConfig, EagleHead, FeatureHook, TargetParts, save_eagle_head
from decode.spec.online.objective import forward_unrolled
from .trainer import seed_all


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True, help="dir with train.npy / heldout.npy (data.py)")
    ap.add_argument("--target", default="cluster/model/weights/stdlib-coder")
    ap.add_argument("--out-dir", required=True, help="scratch: ckpt.pt, log.jsonl")
    ap.add_argument("--export", required=True, help="checkpoint dir to write")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--passes", type=int, default=3, help="unrolled draft steps trained")
    ap.add_argument("--pass-decay", type=float, default=0.8)
    ap.add_argument("--reg", type=float, default=0.1, help="weight of the feature loss")
    ap.add_argument("--intermediate-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-minutes", type=float, default=33.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--detach", action="store_true", help="no gradient through own features")
    return ap.parse_args()


def lr_at(step: int, a) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def head_losses(head, tp: TargetParts, x, f, t_logits, passes: int, detach: bool,
                pass_decay: float, reg_w: float):
    """Total loss and per-pass stats [passes, 3]: soft CE, SmoothL1, top-1
    agreement with the target. Plain tensors only, so torch.compile can fuse it."""
    outs = forward_unrolled(head, x, f, tp, passes, detach)
    t_logits = t_logits.float()
    t_p = torch.softmax(t_logits, -1)
    t_top = t_logits.argmax(-1)
    total, stats = 0.0, []
    for s, g in enumerate(outs):
        lg = tp.logits(g[:, s:]).float()
        ce = (torch.logsumexp(lg, -1) - (t_p[:, s:] * lg).sum(-1)).mean()
        reg = F.smooth_l1_loss(g[:, s:].float(), f[:, s:])
        acc = (lg.argmax(-1) == t_top[:, s:]).float().mean()
        total = total + (pass_decay ** s) * (ce + reg_w * reg)
        stats.append(torch.stack([ce.detach(), reg.detach(), acc]))
    return total, torch.stack(stats)


@torch.no_grad()
def target_pass(target, hook, x, bf16: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = target(input_ids=x).logits
    return hook.f.float(), logits.float()


def main() -> None:
    a = parse()
    torch.set_num_threads(a.threads)
    seed_all(a.seed)
    os.makedirs(a.out_dir, exist_ok=True)
    target = LlamaForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    hook = FeatureHook(target)
    tp = TargetParts(target.model.embed_tokens.weight, target.model.norm.weight,
                     target.lm_head.weight, target.config.rms_norm_eps)
    cfg = EagleConfig.from_target(a.target, a.intermediate_size)
    head = EagleHead(cfg)
    head.init_weights(a.seed)
    decay = [p for p in head.parameters() if p.dim() >= 2]
    no_decay = [p for p in head.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    tfwd = target if a.no_compile else torch.compile(target)
    lossf = head_losses if a.no_compile else torch.compile(head_losses)
    hargs = (a.passes, a.detach, a.pass_decay, a.reg)

    sampler = WindowSampler(load_split(a.work_dir, "train"), a.seq_len, a.batch_size, a.seed)
    held = load_split(a.work_dir, "heldout")
    w = a.seq_len + 1  # fixed held-out windows for the periodic check
    hx = torch.from_numpy(np.stack([held[i * w: i * w + a.seq_len] for i in range(0, 40, 10)]).astype(np.int64))
    hf, hlog = target_pass(target, hook, hx, not a.no_bf16)
    feat_scale = float(hf.pow(2).mean().sqrt())  # rms of f, ~42
    head.feat_scale = feat_scale
    head.emb_mult = float(1.0 / tp.embed.pow(2).mean().sqrt())  # embedding rms ~0.07
    hf = hf / feat_scale
    print(f"head params {sum(p.numel() for p in head.parameters())}, "
          f"{sampler.steps_per_epoch} steps/epoch, feature rms {feat_scale:.2f}", flush=True)

    logf = open(os.path.join(a.out_dir, "log.jsonl"), "w")
    t0 = time.time()
    step = 0
    while step < a.steps:
        if (time.time() - t0) / 60 > a.max_minutes:
            print(f"max-minutes reached at step {step}", flush=True)
            break
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, a)
        x = sampler.batch(step)[:, :-1]
        f, t_logits = target_pass(tfwd, hook, x, not a.no_bf16)
        f = f / feat_scale  # unit-rms training space (see EagleHead.emb_mult)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.no_bf16):
            loss, stats = lossf(head, tp, x, f, t_logits, *hargs)
        stats = stats.tolist()
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), a.grad_clip).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        rec = {"step": step, "loss": round(loss.item(), 4), "lr": round(lr_at(step - 1, a), 6),
               "gnorm": round(gnorm, 3), "elapsed_s": round(time.time() - t0, 1),
               "ce": [round(s[0], 3) for s in stats], "reg": [round(s[1], 4) for s in stats],
               "acc": [round(s[2], 3) for s in stats]}
        if step % a.eval_every == 0 or step == a.steps:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=not a.no_bf16):
                _, hs = head_losses(head, tp, hx, hf, hlog, *hargs)
            hs = hs.tolist()
            rec["heldout_acc"] = [round(s[2], 3) for s in hs]
            rec["heldout_ce"] = [round(s[0], 3) for s in hs]
        logf.write(json.dumps(rec) + "\n")
        logf.flush()
        if step % 10 == 0 or step <= 3 or "heldout_acc" in rec:
            print(json.dumps(rec), flush=True)
        if step % 100 == 0:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                        "feat_scale": feat_scale, "emb_mult": head.emb_mult},
                       os.path.join(a.out_dir, "ckpt.pt"))
    wall = time.time() - t0
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                        "feat_scale": feat_scale, "emb_mult": head.emb_mult},
               os.path.join(a.out_dir, "ckpt.pt"))
    save_eagle_head(head, a.export, os.path.basename(os.path.normpath(a.target)))
    summary = {"steps": step, "tokens_seen": step * a.batch_size * a.seq_len,
               "wall_s": round(wall, 1), "args": vars(a)}
    with open(os.path.join(a.out_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
