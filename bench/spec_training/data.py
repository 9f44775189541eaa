"""Tokenize the stdlib split into flat uint16 token streams and serve batches.

Each file becomes ``[<|endoftext|>] + tokens(file)``; files are concatenated in
sorted path order. Training samples are non-overlapping windows of
``seq_len + 1`` tokens, visited in a per-epoch permutation derived only from
(seed, epoch), so a resumed run sees exactly the batches a fresh run would.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from tokenizers import Tokenizer

from .corpus import iter_stdlib_files, split_files
from .tokenizer import EOT_ID


def encode_files(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    encs = tok.encode_batch(texts, add_special_tokens=False)
    out: list[int] = []
    for e in encs:
        out.append(EOT_ID)
        out.extend(e.ids)
    assert tok.get_vocab_size() <= 65536
    return np.asarray(out, dtype=np.uint16)


def prepare(tokenizer_dir: str, work_dir: str) -> dict[str, np.ndarray]:
    """Write train.npy / heldout.npy under work_dir; returns both arrays."""
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    train, heldout = split_files(iter_stdlib_files())
    arrays = {
        "train": encode_files(tok, [f.text for f in train]),
        "heldout": encode_files(tok, [f.text for f in heldout]),
    }
    os.makedirs(work_dir, exist_ok=True)
    for name, arr in arrays.items():
        np.save(os.path.join(work_dir, f"{name}.npy"), arr)
    return arrays


def load_split(work_dir: str, name: str) -> np.ndarray:
    return np.load(os.path.join(work_dir, f"{name}.npy"))


class WindowSampler:
    """Deterministic epoch-shuffled batches of (seq_len + 1)-token windows."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.tokens = tokens
        self.win = seq_len + 1
        self.batch_size = batch_size
        self.seed = seed
        self.n_windows = len(tokens) // self.win
        self.steps_per_epoch = self.n_windows // batch_size

    def batch(self, step: int) -> torch.Tensor:
        """Batch number ``step`` (0-based), shape [batch_size, seq_len + 1], int64."""
        epoch, i = divmod(step, self.steps_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        idx = perm[i * self.batch_size : (i + 1) * self.batch_size]
        rows = [self.tokens[j * self.win : (j + 1) * self.win] for j in idx]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def eval_windows(tokens: np.ndarray, seq_len: int) -> list[torch.Tensor]:
    """Cover the held-out stream with non-overlapping windows (last one shorter)."""
    out = []
    for start in range(0, len(tokens) - 1, seq_len):
        chunk = tokens[start : start + seq_len + 1]
        if len(chunk) >= 2:
            out.append(torch.from_numpy(chunk.astype(np.int64))[None])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", required=True, help="dir holding tokenizer.json")
    ap.add_argument("--work-dir", required=True)
    args = ap.parse_args()
    arrays = prepare(args.tokenizer, args.work_dir)
    for name, arr in arrays.items():
        print(f"{name}: {len(arr)} tokens")


if __name__ == "__main__":
    main()
