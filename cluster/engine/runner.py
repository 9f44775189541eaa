"""Turns a step plan into tensors, runs the model over the paged cache, returns logits."""
from __future__ import annotations

import torch

from cluster.engine.scheduler import StepPlan
from cluster.engine.sequence import Sequence
from cluster.model.attention import AttentionBackend, AttentionBatch, PrefillSpan
from cluster.model.llama import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv_arena: torch.Tensor, backend: AttentionBackend,
                 block_size: int, device: torch.device):
        self.model = model
        self.kv_arena = kv_arena
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.layer_hook = None   # called with each layer index once its KV is stored (KV push)

    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, list[Sequence]]:
        """Returns fp32 logits and the sequences they belong to, in order: one row per sequence
        whose chunk reaches its end, k+1 rows for a verification of k draft tokens."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        prefills: list[PrefillSpan] = []
        verifies: list[PrefillSpan] = []
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            offset = len(input_ids)
            if chunk.draft:
                input_ids.append(seq.token_ids[start])
                input_ids.extend(chunk.draft)
            else:
                input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if chunk.draft:
                verifies.append(PrefillSpan(offset, n, start + n, tuple(blocks)))
                logits_rows.extend(range(offset, offset + n))
                sampled.append(seq)
                continue
            if n > 1:
                prefills.append(PrefillSpan(offset, n, start + n, tuple(blocks)))
            if chunk.samples:
                logits_rows.append(offset + n - 1)
                sampled.append(seq)
        batch = AttentionBatch(
            num_decode=len(plan.decodes),
            decode_context_lens=tuple(c.start + 1 for c in plan.decodes),
            decode_block_tables=tuple(tuple(c.seq.block_ids) for c in plan.decodes),
            prefills=tuple(prefills),
            verifies=tuple(verifies),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_size=bs,
        )
        meta = self.backend.prepare(batch)
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_arena, self.backend, meta,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            layer_hook=self.layer_hook,
        )
        return logits, sampled

    def run_spans(self, spans: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """A forward pass outside the scheduler (a draft model's own steps): each span is
        (tokens, first position, block ids); returns fp32 logits of each span's last token."""
        bs = self.block_size
        order = sorted(range(len(spans)), key=lambda i: len(spans[i][0]) > 1)   # decodes first
        input_ids, positions, slots, rows, prefills, lens, tables = [], [], [], [0] * len(spans), [], [], []
        for i in order:
            tokens, start, blocks = spans[i]
            n = len(tokens)
            offset = len(input_ids)
            input_ids.extend(tokens)
            positions.extend(range(start, start + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if n > 1:
                prefills.append(PrefillSpan(offset, n, start + n, tuple(blocks)))
            else:
                lens.append(start + 1)
                tables.append(tuple(blocks))
            rows[i] = offset + n - 1
        batch = AttentionBatch(num_decode=len(lens), decode_context_lens=tuple(lens),
                               decode_block_tables=tuple(tables), prefills=tuple(prefills),
                               slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                               block_size=bs)
        return self.model(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                          torch.tensor(positions, dtype=torch.long, device=self.device),
                          self.kv_arena, self.backend, self.backend.prepare(batch),
                          torch.tensor(rows, dtype=torch.long, device=self.device))
