"""Fine-tuning a tenant's head on its served traffic, and the score promotion and rollback use.

The head is the training-side module of decode/spec/training (the same function as the serving
head, in fp32, differentiable), loaded from the base head's directory; only `TRAINABLE` tensors
learn (messages.py: the head's KV stays the base head's). Each round starts from the tenant's live
head and runs `steps` AdamW steps over its training samples with the training-time test (several
unrolled draft steps, each fed the head's own output: decode/spec/training/eagle.py
`forward_unrolled`), token cross-entropy on the tokens the target emitted.

The score is the mean accepted length of a greedy chain of `depth` drafts from every position of
the samples: the unrolled passes are teacher-forced with the true tokens, which are exactly the
drafts of a chain while it is still accepted, so it counts what serving would accept (the serving
head also attends to the prompt before a sample's first position; the replay does not).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from decode.spec.compat import is_eagle3, read_eagle_config
from decode.spec.online.messages import TRAINABLE, TRAINABLE_EAGLE3, ServedSample
from decode.spec.training.eagle import load_eagle_head, load_target_parts
from decode.spec.training.eagle3 import load_eagle3_head, target_to_draft

MAX_CHUNK = 256        # positions per training sequence: longer samples are cut (bounded memory and time)
_NAME_OF = {"norm.weight": "norm_weight"}     # checkpoint name -> the EAGLE-3 training module's


@dataclass(frozen=True)
class Chunk:
    tokens: torch.Tensor       # [T] int64
    features: torch.Tensor     # [T, H] fp32


def chunks_of(samples: list[ServedSample]) -> list[Chunk]:
    out = []
    for s in samples:
        tokens = torch.tensor(s.tokens, dtype=torch.long)
        for a in range(0, len(tokens), MAX_CHUNK):
            if len(tokens) - a >= 8:
                out.append(Chunk(tokens[a:a + MAX_CHUNK], s.features[a:a + MAX_CHUNK].float()))
    return out


class HeadTrainer:
    def __init__(self, head_dir: Path, target_dir: Path, depth: int = 4, lr: float = 1e-4, seed: int = 0):
        self.eagle3 = is_eagle3(read_eagle_config(head_dir))
        self.head = load_eagle3_head(str(head_dir)) if self.eagle3 else load_eagle_head(str(head_dir))
        self.tp = load_target_parts(str(target_dir))
        self.names = TRAINABLE_EAGLE3 if self.eagle3 else TRAINABLE
        self.t2d = target_to_draft(self.head.d2t, self.tp.embed.shape[0]) if self.eagle3 else None
        self.depth, self.lr, self.seed = depth, lr, seed
        params = dict(self.head.named_parameters())
        for p in params.values():
            p.requires_grad_(False)
        self._params = {name: params[_NAME_OF.get(name, name)] for name in self.names}
        self.base = self.tensors()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The trainable tensors as they are now, by checkpoint name."""
        return {name: p.detach().clone() for name, p in self._params.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(tensors[name])

    def _logits_and_labels(self, g: torch.Tensor, tokens: torch.Tensor, s: int):
        """Rows s..T-2 of pass s's output and the tokens they should predict (draft ids for EAGLE-3)."""
        rows, labels = g[0, s:-1], tokens[s + 1:]
        if self.eagle3:
            return self.head.draft_logits(rows).float(), self.t2d[labels]
        return self.tp.logits(rows).float(), labels

    def _passes(self, chunk: Chunk, grad: bool) -> list[torch.Tensor]:
        with torch.set_grad_enabled(grad):
            return self.head.forward_unrolled(chunk.tokens[None], chunk.features[None], self.tp, self.depth)

    def train(self, start: dict[str, torch.Tensor], samples: list[ServedSample], steps: int,
              max_passes: float = 2.0) -> dict[str, torch.Tensor]:
        """At most `steps` AdamW steps from `start` over the samples' chunks, and at most
        `max_passes` passes over them (on a few thousand tokens more steps overfit:
        bench/spec_online_tuning.py); the trained tensors."""
        self.load(start)
        chunks = chunks_of(samples)
        if not chunks:
            return self.tensors()
        steps = int(min(steps, max(1.0, max_passes * sum(len(c.tokens) for c in chunks) / MAX_CHUNK)))
        params = list(self._params.values())
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        rng = random.Random(self.seed)
        try:
            for _ in range(steps):
                chunk = rng.choice(chunks)
                outs = self._passes(chunk, grad=True)
                loss = 0.0
                for s, g in enumerate(outs):
                    logits, labels = self._logits_and_labels(g, chunk.tokens, s)
                    loss = loss + (0.8 ** s) * F.cross_entropy(logits, labels, ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
        finally:
            for p in params:
                p.requires_grad_(False)
        return self.tensors()

    def score(self, tensors: dict[str, torch.Tensor], samples: list[ServedSample]) -> float:
        """Mean accepted length of a greedy chain of `depth` drafts, over every start position."""
        accepted = self.accepted_lengths(tensors, samples)
        return float(accepted.float().mean()) if len(accepted) else 0.0

    def compare(self, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                samples: list[ServedSample]) -> tuple[float, float, float]:
        """Both heads' scores on the same start positions, and the standard error of their mean
        difference (paired: the noise a decision on these samples must beat)."""
        x, y = self.accepted_lengths(a, samples).float(), self.accepted_lengths(b, samples).float()
        if len(x) < 2:
            return float(x.mean()) if len(x) else 0.0, float(y.mean()) if len(y) else 0.0, float("inf")
        return float(x.mean()), float(y.mean()), float((x - y).std() / len(x) ** 0.5)

    @torch.no_grad()
    def accepted_lengths(self, tensors: dict[str, torch.Tensor], samples: list[ServedSample]) -> torch.Tensor:
        """Per start position p (all samples): the drafts a greedy chain from p would get accepted."""
        self.load(tensors)
        out = []
        for chunk in chunks_of(samples):
            outs = self._passes(chunk, grad=False)
            t = len(chunk.tokens)
            hits = torch.zeros((self.depth, t), dtype=torch.bool)
            for s, g in enumerate(outs):
                logits, labels = self._logits_and_labels(g, chunk.tokens, s)
                hits[s, s:t - 1] = logits.argmax(-1) == labels     # row j predicts x_{j+1}
            n = t - self.depth      # starts p whose whole chain p..p+depth-1 has labels
            if n <= 0:
                continue
            run = torch.ones(n, dtype=torch.bool)
            length = torch.zeros(n, dtype=torch.long)
            for s in range(self.depth):
                run &= hits[s, s:s + n]
                length += run
            out.append(length)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
