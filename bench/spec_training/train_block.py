"""Train the default model's DFlash-style block drafter (decode/spec/heads/block.py) on CPU.

Input: smollm_data.py's shards (the target's own greedy answers with the three depths of
features our engine computed while answering: the EAGLE-3 head's data). Each step is a batch of
anchors (a sequence and an answer position n): the pending token x_n, the features of the last
`--context` positions before it, and the target's next `--block` tokens as labels, CE weighted
by `--decay` per block row. The last `--val-share` of sequences are held out; the figure that
matters is the held-out mean accepted length of a greedy chain (leading rows that match).

    W=/tmp/ss-block
    python -m bench.spec_training.smollm_data --out $W/answers.jsonl --limit 1000
    python -m bench.spec_training.train_block --features $W/answers.features --out-dir $W/run \\
        --export cluster/model/weights/smollm2-135m-block --max-minutes 20

Deterministic from `--seed` given the same answers file.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from bench.spec_training.head_training import clipped_step, draft_vocab, head_optimizer, set_lr, write_summary
from bench.spec_training.losses import block_losses
from bench.spec_training.train_eagle3 import fingerprint, load_shards, target_dir, target_parts
from decode.spec.heads.block import BlockConfig, BlockDrafter, draft_logits, save_block_drafter
from decode.spec.heads.eagle import EagleConfig, TargetParts
from decode.spec.online.objective import target_to_draft


def unit_scale(tp: TargetParts) -> float:
    """emb_scale that brings the target's embeddings to unit rms (the mask row's scale)."""
    return float(1.0 / tp.embed.float().pow(2).mean().sqrt())


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", type=Path, required=True, help="smollm_data.py's shard folder")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--intermediate-size", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=192, help="anchors a step")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--decay", type=float, default=0.8)
    ap.add_argument("--short-context", type=float, default=0.25, help="share of anchors given a shorter window")
    ap.add_argument("--val-share", type=float, default=0.05)
    ap.add_argument("--max-minutes", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class Anchors:
    """Every answer position of every sequence, gathered into batches of drafter inputs."""

    def __init__(self, seqs: list[dict], block: int, context: int):
        self.seqs, self.block, self.context = seqs, block, context
        self.full = [torch.cat([s["tokens"], s["labels"][-1:]]).long() for s in seqs]
        self.points = [(i, n) for i, s in enumerate(seqs) for n in torch.nonzero(s["mask"]).flatten().tolist()]

    def batch(self, points: list[tuple[int, int]], rng: random.Random | None, short: float):
        B, C, K = len(points), self.context, self.block
        H3 = self.seqs[0]["feats"].shape[1]
        feats = torch.zeros(B, C, H3, dtype=torch.bfloat16)
        labels = torch.full((B, K), -100, dtype=torch.long)
        first, ctx_len, pos = (torch.zeros(B, dtype=torch.long) for _ in range(3))
        for b, (i, n) in enumerate(points):
            c = min(C, n)
            if rng is not None and c > 1 and rng.random() < short:
                c = rng.randint(1, c)
            if c:
                feats[b, C - c:] = self.seqs[i]["feats"][n - c:n]
            full = self.full[i]
            ys = full[n + 1:n + 1 + K]
            labels[b, :len(ys)] = ys
            first[b], ctx_len[b], pos[b] = full[n], c, n
        return first, feats.float(), ctx_len, pos, labels


def accepted_length(drafter, tp, head_rows, anchors: Anchors, points, K: int) -> tuple[float, list[float]]:
    """Held-out: mean leading rows equal to the labels (a greedy chain's accepted length) and
    the cumulative acceptance by row."""
    total, by_row, n = 0.0, [0.0] * K, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for a in range(0, len(points), 256):
            first, feats, ctx_len, pos, labels = anchors.batch(points[a:a + 256], None, 0.0)
            g = drafter(lambda ids: torch.nn.functional.embedding(ids, tp.embed), first,
                        drafter.fused(feats), ctx_len, pos)
            hit = (drafter.d2t[draft_logits(g, tp, head_rows).argmax(-1)] == labels).long().cumprod(1)
            total += float(hit.sum())
            for i in range(K):
                by_row[i] += float(hit[:, i].sum())
            n += len(first)
    return total / n, [round(x / n, 4) for x in by_row]


def build(a, tdir: str, tp, train_anchors: Anchors, layers) -> BlockDrafter:
    base = EagleConfig.from_target(tdir, a.intermediate_size)
    cfg = BlockConfig(**vars(base), block_size=a.block, context=a.context, num_layers=a.layers,
                      feature_layers=tuple(layers), emb_scale=unit_scale(tp), draft_vocab_size=a.draft_vocab)
    labels = torch.cat([s["labels"][s["mask"]].long() for s in train_anchors.seqs])
    d2t, cover = draft_vocab(labels, a.draft_vocab, base.vocab_size)
    print(f"draft vocab {a.draft_vocab}: covers {cover:.4f} of the training labels", flush=True)
    drafter = BlockDrafter(cfg, d2t)
    drafter.init_weights(a.seed)
    sample = torch.cat([s["feats"][:64].float() for s in train_anchors.seqs[:64]])
    H = cfg.hidden_size
    with torch.no_grad():
        drafter.depth_scale.copy_(sample.view(len(sample), 3, H).pow(2).mean((0, 2)).sqrt())
    return drafter


def train(a) -> None:
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    layers, target, seqs = load_shards(a.features)
    tdir = target_dir(a.target or target)
    n_val = max(1, int(len(seqs) * a.val_share))
    train_set, val_set = Anchors(seqs[:-n_val], a.block, a.context), Anchors(seqs[-n_val:], a.block, a.context)
    val_points = random.Random(0).sample(val_set.points, min(3000, len(val_set.points)))
    tp = target_parts(tdir)
    drafter = build(a, tdir, tp, train_set, layers)
    head_rows = tp.lm_head[drafter.d2t]
    t2d = target_to_draft(drafter.d2t, tp.embed.shape[0])
    opt = head_optimizer(drafter, a.lr)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    log = (a.out_dir / "log.jsonl").open("w")
    print(f"{len(train_set.points)} training anchors, {len(val_points)} held out; drafter params "
          f"{sum(p.numel() for p in drafter.parameters())}", flush=True)
    rng = random.Random(a.seed)
    order: list = []
    t0, step = time.time(), 0
    while step < a.steps and (time.time() - t0) / 60 < a.max_minutes:
        if len(order) < a.batch:
            order = list(train_set.points)
            rng.shuffle(order)
        points, order = order[:a.batch], order[a.batch:]
        set_lr(opt, step, a.steps, a.lr, a.warmup)
        first, feats, ctx_len, pos, labels = train_set.batch(points, rng, a.short_context)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, accs = block_losses(drafter, tp, head_rows, first, feats, ctx_len, pos,
                                      torch.where(labels >= 0, t2d[labels.clamp(min=0)], labels), a.decay)
        clipped_step(loss, drafter, opt)
        step += 1
        rec = {"step": step, "loss": round(float(loss.detach()), 4), "acc": [round(x, 3) for x in accs],
               "elapsed_s": round(time.time() - t0, 1)}
        if step % 200 == 0:
            rec["val_accepted"] = accepted_length(drafter, tp, head_rows, val_set, val_points, a.block)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % 25 == 0 or "val_accepted" in rec:
            print(json.dumps(rec), flush=True)
    final = accepted_length(drafter, tp, head_rows, val_set, val_points, a.block)
    save_block_drafter(drafter, str(a.export), Path(tdir).name, fingerprint(tdir))
    write_summary(a.out_dir, step, t0, final, a)


def main() -> None:
    train(parse())


if __name__ == "__main__":
    main()
