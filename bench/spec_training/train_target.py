"""Train the target model (``stdlib-coder``). See README.md for the command."""
from __future__ import annotations

import argparse

from .trainer import TrainArgs, train


def build_parser(defaults: TrainArgs) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work-dir", required=True, help="dir with train.npy/heldout.npy")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--tokenizer", required=True)
    for name in ("steps", "batch_size", "seq_len", "warmup", "seed", "threads",
                 "ckpt_every", "eval_every", "eval_windows"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in ("lr", "min_lr_ratio", "weight_decay", "max_minutes"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--resume", action="store_true")
    return ap


def args_from(ns: argparse.Namespace, shape: str, teacher: str | None = None) -> TrainArgs:
    kw = {k: v for k, v in vars(ns).items()
          if k not in ("no_compile", "no_bf16", "teacher")}
    return TrainArgs(shape=shape, compile=not ns.no_compile, bf16=not ns.no_bf16,
                     teacher=teacher, **kw)


def main() -> None:
    ap = build_parser(TrainArgs(shape="target", work_dir="", out_dir="", tokenizer="", steps=700))
    train(args_from(ap.parse_args(), "target"))


if __name__ == "__main__":
    main()
