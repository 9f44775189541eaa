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
        self.eagle = None        # an EagleHead: run over every computed token, its KV in the arena's last layer
        self.block_features = None   # [num_blocks, H]: hidden state at each block's last slot (prefix hits)
        self.feature_valid: list[bool] = []   # per block: written by this engine since the block was allocated
        self.last_rows: dict[Sequence, tuple[int, int]] = {}   # seq -> (first row, first position) of last step
        self.last_hidden: torch.Tensor | None = None

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
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        out = self.model(ids_t, pos_t, self.kv_arena, self.backend, meta,
                         torch.tensor(logits_rows, dtype=torch.long, device=self.device),
                         layer_hook=self.layer_hook, return_hidden=self.eagle is not None)
        if self.eagle is None:
            return out, sampled
        logits, hidden = out
        self._run_eagle(plan, ids_t, pos_t, hidden, meta)
        return logits, sampled

    def _run_eagle(self, plan: StepPlan, ids_t, pos_t, hidden: torch.Tensor, meta) -> None:
        """The head over the step's tokens with the true features: input j pairs x_j with f_{j-1}."""
        bs = self.block_size
        total = hidden.shape[0]
        carry, src, ends_rows, ends_blocks = [], [], [], []
        self.last_rows = {}
        offset = 0
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            self.last_rows[seq] = (offset, start)
            if start == 0:
                src.append(-1)                          # f_{-1} = 0
            else:
                src.append(total + len(carry))
                carry.append(self._feature_before(seq, start))
            src.extend(range(offset, offset + n - 1))
            for p in range(start, start + n):
                if p % bs == bs - 1:
                    ends_rows.append(offset + p - start)
                    ends_blocks.append(seq.block_ids[p // bs])
            offset += n
        zero = hidden.new_zeros((1, hidden.shape[1]))
        table = torch.cat([hidden, *([torch.stack(carry)] if carry else []), zero])
        index = torch.tensor([len(table) - 1 if i < 0 else i for i in src], dtype=torch.long, device=self.device)
        self.eagle(ids_t, table.index_select(0, index), pos_t, self.kv_arena[-1], self.backend, meta)
        if self.layer_hook is not None:
            self.layer_hook(self.kv_arena.shape[0] - 1)
        for b in ends_blocks:
            self.feature_valid[b] = True
        if ends_rows:
            self.block_features.index_copy_(0, torch.tensor(ends_blocks, device=self.device),
                                            hidden.index_select(0, torch.tensor(ends_rows, device=self.device)))
        self.last_hidden = hidden

    def _feature_before(self, seq: Sequence, start: int) -> torch.Tensor:
        if seq.spec_feature is not None and seq.spec_feature_pos == start - 1:
            return seq.spec_feature
        # A chunk that starts after a prefix-cache hit: the feature kept for the hit's last block.
        block = seq.block_ids[start // self.block_size - 1]
        assert start % self.block_size == 0 and self.feature_valid[block], (seq.request_id, start)
        return self.block_features[block]

    def invalidate_features(self, blocks: list[int]) -> None:
        for b in blocks:
            self.feature_valid[b] = False

    def usable_hits(self, hits: list[int]) -> list[int]:
        """The longest prefix of a cache hit whose last block has a feature (blocks filled by a KV
        transfer were computed elsewhere and have none)."""
        n = len(hits)
        while n and not self.feature_valid[hits[n - 1]]:
            n -= 1
        return hits[:n]

    def keep_features(self) -> None:
        """After the scheduler's update: remember each sequence's feature at its last computed position."""
        if self.last_hidden is None:
            return
        for seq, (row, start) in self.last_rows.items():
            computed = seq.num_computed_tokens - start
            if computed > 0:
                seq.spec_feature = self.last_hidden[row + computed - 1].clone()
                seq.spec_feature_pos = start + computed - 1
        self.last_hidden = None
        self.last_rows = {}

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
