"""Train the default model's EAGLE-3-style head (eagle3.py) on CPU.

Input: smollm_data.py's shards (the target's own greedy answers, with the three depths of
features our engine computed while answering). AdamW over the head; each step is a batch of
whole sequences (sorted by length, so little padding), the training-time test unrolled
`--passes` times, CE on answer positions whose label is in the draft vocabulary; the last
`--val-share` of sequences are held out.

    W=/work/scratch/eagle3
    python -m bench.spec_training.smollm_data --out $W/answers.jsonl --limit 2400
    python -m bench.spec_training.train_eagle3 --features $W/answers.features --out-dir $W/run \
        --export cluster/model/weights/smollm2-135m-eagle3 --epochs 2 --max-minutes 30

Deterministic from `--seed` given the same answers file (the order, the init and the data order
depend on it alone).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from bench.spec_training.head_training import clipped_step, draft_vocab, head_optimizer, set_lr, write_summary
from bench.spec_training.losses import unrolled_losses
from decode.spec.heads.eagle import EagleConfig, TargetParts
from decode.spec.heads.eagle3 import Eagle3Config, Eagle3Head, eagle3_feature_layers, save_eagle3_head
from decode.spec.online.objective import target_to_draft


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = ap
    t.add_argument("--features", type=Path, required=True, help="smollm_data.py's shard folder")
    t.add_argument("--out-dir", type=Path, required=True)
    t.add_argument("--export", type=Path, required=True)
    t.add_argument("--target", default=None)
    t.add_argument("--draft-vocab", type=int, default=8192)
    t.add_argument("--intermediate-size", type=int, default=1536)
    t.add_argument("--passes", type=int, default=3)
    t.add_argument("--pass-decay", type=float, default=0.8)
    t.add_argument("--batch-tokens", type=int, default=3072)
    t.add_argument("--epochs", type=float, default=2.0)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--val-share", type=float, default=0.04)
    t.add_argument("--max-minutes", type=float, default=30.0)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def target_dir(arg: str | None) -> str:
    if arg:
        return arg
    from cluster.config import default_model_dir   # noqa: PLC0415
    return str(default_model_dir())


def load_shards(folder: Path) -> tuple[tuple[int, ...], str, list[dict]]:
    """smollm_data.py's shards as training sequences: the tokens fed (all but the last), their
    features, labels (the next token: the target's own greedy choice on answer positions) and
    the answer mask."""
    seqs, layers, target = [], (), ""
    for path in sorted(folder.glob("*.pt")):
        shard = torch.load(path)
        layers, target = tuple(shard["layers"]), shard["target"]
        for r in shard["seqs"]:
            tokens, n = r["tokens"], len(r["tokens"]) - 1
            mask = torch.zeros(n, dtype=torch.bool)
            mask[r["prompt_len"] - 1:] = True
            seqs.append({"tokens": tokens[:-1], "feats": r["feats"], "labels": tokens[1:], "mask": mask})
    return layers, target, seqs


def batches(seqs: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    """Whole sequences grouped by length (little padding), the groups in a seeded order."""
    order = sorted(seqs, key=lambda s: len(s["tokens"]))
    groups, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * len(s["tokens"]) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(s)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def collate(group: list[dict], t2d: torch.Tensor):
    T = max(len(s["tokens"]) for s in group)
    B, H3 = len(group), group[0]["feats"].shape[1]
    tokens = torch.zeros(B, T, dtype=torch.long)
    feats = torch.zeros(B, T, H3, dtype=torch.bfloat16)
    labels = torch.full((B, T), -100, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, s in enumerate(group):
        n = len(s["tokens"])
        tokens[i, :n] = s["tokens"].long()
        feats[i, :n] = s["feats"]
        labels[i, :n] = t2d[s["labels"].long()]
        mask[i, :n] = s["mask"]
    return tokens, feats.float(), labels, mask


def target_parts(tdir: str) -> TargetParts:
    from decode.spec.heads.eagle import load_target_parts   # noqa: PLC0415
    return load_target_parts(tdir, torch.float32)


def fingerprint(tdir: str) -> str:
    from decode.spec.compat import weights_fingerprint   # noqa: PLC0415
    return weights_fingerprint(Path(tdir))


def build_head(a, tdir: str, tp: TargetParts, train: list[dict], layers) -> Eagle3Head:
    base = EagleConfig.from_target(tdir, a.intermediate_size)
    labels = torch.cat([s["labels"][s["mask"]].long() for s in train])
    d2t, cover = draft_vocab(labels, a.draft_vocab, base.vocab_size)
    print(f"draft vocab {a.draft_vocab}: covers {cover:.4f} of the training labels", flush=True)
    cfg = Eagle3Config(**vars(base), draft_vocab_size=a.draft_vocab, feature_layers=tuple(layers))
    head = Eagle3Head(cfg, d2t)
    head.init_weights(a.seed)
    H = cfg.hidden_size
    with torch.no_grad():
        head.fc.weight[:, H:] -= torch.eye(H)       # fuse's output is no earlier feature: no identity
        head.lm_head.weight.copy_(tp.lm_head[d2t])  # start from the target's own rows
        head.norm_weight.copy_(tp.norm)
        sample = torch.cat([s["feats"][:64].float() for s in train[:64]])
        head.depth_scale.copy_(sample.view(len(sample), 3, H).pow(2).mean((0, 2)).sqrt())
    head.emb_mult = float(1.0 / tp.embed.pow(2).mean().sqrt())
    return head


def evaluate(head, tp, val, t2d, passes) -> list[float]:
    accs, n = [0.0] * passes, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for group in batches(val, 4096, random.Random(0)):
            _, acc = unrolled_losses(head, *collate(group, t2d), tp, passes)
            accs = [x + y * len(group) for x, y in zip(accs, acc)]
            n += len(group)
    return [round(x / n, 4) for x in accs]


def train(a) -> None:
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    layers, target, seqs = load_shards(a.features)
    tdir = target_dir(a.target or target)
    n_val = max(1, int(len(seqs) * a.val_share))
    train_seqs, val = seqs[:-n_val], seqs[-n_val:]
    tp = target_parts(tdir)
    head = build_head(a, tdir, tp, train_seqs, layers)
    t2d = target_to_draft(head.d2t, tp.embed.shape[0])
    rng = random.Random(a.seed)
    per_epoch = len(batches(train_seqs, a.batch_tokens, random.Random(0)))
    total = int(per_epoch * a.epochs)
    opt = head_optimizer(head, a.lr)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    log = (a.out_dir / "log.jsonl").open("w")
    print(f"{len(train_seqs)} training sequences, {n_val} held out, {per_epoch} steps an epoch, {total} steps; "
          f"head params {sum(p.numel() for p in head.parameters())}", flush=True)
    print(json.dumps({"step": 0, "val_acc": evaluate(head, tp, val, t2d, a.passes)}), flush=True)
    t0, step, queue = time.time(), 0, []
    while step < total and (time.time() - t0) / 60 < a.max_minutes:
        if not queue:
            queue = batches(train_seqs, a.batch_tokens, rng)
        set_lr(opt, step, total, a.lr, a.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses, accs = unrolled_losses(head, *collate(queue.pop(), t2d), tp, a.passes)
        loss = sum(a.pass_decay ** s * x for s, x in enumerate(losses))
        clipped_step(loss, head, opt)
        step += 1
        rec = {"step": step, "loss": round(float(loss.detach()), 4), "acc": [round(x, 3) for x in accs],
               "elapsed_s": round(time.time() - t0, 1)}
        if step % 100 == 0 or step == total:
            rec["val_acc"] = evaluate(head, tp, val, t2d, a.passes)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % 20 == 0 or "val_acc" in rec:
            print(json.dumps(rec), flush=True)
    final = evaluate(head, tp, val, t2d, a.passes)
    save_eagle3_head(head, str(a.export), Path(tdir).name, fingerprint(tdir))
    write_summary(a.out_dir, step, t0, final, a)


def main() -> None:
    train(parse())


if __name__ == "__main__":
    main()
