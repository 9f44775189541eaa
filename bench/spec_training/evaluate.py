"""Held-out loss / perplexity of shipped checkpoints, plus a unigram baseline.

Held-out tokens are re-derived from the stdlib with each model's own
tokenizer (same split as training, see corpus.py), covered by non-overlapping
1024-token windows; every held-out token after the first is predicted exactly
once. Weights are evaluated as shipped (bf16 values) with fp32 compute.

Unigram baseline: token frequencies on the training split with add-one
smoothing over the full vocabulary, scored on the same predicted positions.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from .corpus import iter_stdlib_files, split_files
from .data import encode_files
from .trainer import heldout_loss


def split_tokens(tokenizer_dir: str) -> tuple[np.ndarray, np.ndarray]:
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    train, heldout = split_files(iter_stdlib_files())
    return encode_files(tok, [f.text for f in train]), encode_files(tok, [f.text for f in heldout])


def heldout_windows(tokenizer_dir: str, n: int, length: int, room: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens evenly spaced over the held-out stream, each leaving `room`
    tokens after it (for a reference continuation)."""
    heldout = split_tokens(tokenizer_dir)[1].tolist()
    span = len(heldout) - length - room
    return [heldout[s: s + length] for s in (i * span // n for i in range(n))]


def unigram_loss(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout[1:]].mean())


def eval_model(model_dir: str, heldout: np.ndarray, seq_len: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    loss, n = heldout_loss(model, heldout, seq_len, max_windows=None, bf16=False)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "loss": loss, "ppl": math.exp(loss), "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("models", nargs="+", help="HF model dirs (same tokenizer)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train, heldout = split_tokens(args.models[0])
    vocab = Tokenizer.from_file(os.path.join(args.models[0], "tokenizer.json")).get_vocab_size()
    uni = unigram_loss(train, heldout, vocab)
    results = {"unigram": {"loss": uni, "ppl": math.exp(uni), "tokens": len(heldout) - 1}}
    for d in args.models:
        results[os.path.basename(os.path.normpath(d))] = eval_model(d, heldout, args.seq_len)
    print(f"held-out tokens: {len(heldout) - 1}")
    print(f"| model | params | loss (nats/token) | perplexity |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r.get('params', '-')} | {r['loss']:.4f} | {r['ppl']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
