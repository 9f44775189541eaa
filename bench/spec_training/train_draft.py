"""Train a draft model: distilled from the target (``--teacher DIR``) or from
the data alone (no ``--teacher``). Both use the same shape, data order, seed and
number of steps, so the only difference is the loss.

Distillation loss: ``alpha * KL(teacher || student) + (1 - alpha) * CE`` with
the teacher's logits computed on the fly (bf16 autocast, no grad).
"""
from __future__ import annotations

from .train_target import args_from, build_parser
from .trainer import TrainArgs, train


def main() -> None:
    defaults = TrainArgs(shape="draft", work_dir="", out_dir="", tokenizer="", steps=400,
                         lr=3e-3, warmup=30)
    ap = build_parser(defaults)
    ap.add_argument("--teacher", default=None, help="HF dir of the target; omit for data-only")
    ap.add_argument("--alpha", type=float, default=defaults.alpha, help="weight of the KL term")
    ap.add_argument("--temperature", type=float, default=defaults.temperature)
    ns = ap.parse_args()
    train(args_from(ns, "draft", teacher=ns.teacher))


if __name__ == "__main__":
    main()
