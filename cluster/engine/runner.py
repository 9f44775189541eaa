"""Turns a step plan into tensors, runs the model over the paged cache, returns its rows
(`ForwardOutput`: the logits to sample from, the sequences they belong to, prompt logprob rows).

A speculator that reads the target's hidden states (decode/spec/: the EAGLE head) is the
runner's `hidden_hook`, called after the target's forward with the step's inputs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cluster.engine import draft_tree
from cluster.engine.compaction import Compactor
from cluster.engine.scheduler import StepPlan
from cluster.engine.sequence import Sequence
from cluster.kv.compaction import QueryCapture
from cluster.model.attention import AttentionBackend, AttentionBatch, PrefillSpan
from cluster.model.llama import CausalLM
from cluster.parallel.expert_balancer import ExpertBalancer
from cluster.parallel.step_message import StepMessage, StepSender

# (plan, input_ids, positions, hidden, meta): a pass over the target's hidden states of a step.
HiddenHook = Callable[[StepPlan, torch.Tensor, torch.Tensor, torch.Tensor, object], None]


class PromptLogits(NamedTuple):
    """Rows of a prompt's logprobs: fp32 logits of its positions from `first` on."""
    seq: Sequence
    first: int
    logits: torch.Tensor


@dataclass(frozen=True)
class ForwardOutput:
    """One forward pass's rows: `logits` [rows, V] fp32 in the order of `sampled` (one row per
    sequence whose chunk reaches its end, k+1 for a verification of k draft tokens), and the
    prompt logprob rows asked for (`prompt_logits`)."""
    logits: torch.Tensor
    sampled: list[Sequence]
    prompt_logits: tuple[PromptLogits, ...] = ()


class BatchLayout:
    """Lays out one forward pass's flat run of tokens and its `AttentionBatch`. Callers add
    decodes first, then verification spans, then prefill chunks (the order the backends read)."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.decode_lens: list[int] = []
        self.decode_tables: list[tuple[int, ...]] = []
        self.prefills: list[PrefillSpan] = []
        self.verifies: list[PrefillSpan] = []

    def add(self, tokens, start: int, blocks, kind: str = "decode", tree: tuple[int, ...] = (),
            seq: Sequence | None = None, capture: QueryCapture | None = None) -> int:
        """Tokens at positions start.. with their KV in `blocks`; kind is decode (one token),
        verify or prefill. A verification's `tree` (the drafts' parents) puts each draft at the
        position of its depth, its KV still at the next slot. A windowed `seq` (cluster/kv/window.py)
        keeps its live blocks only: its tokens sit at cache index position - cache_offset (a
        compacted one too). `capture`: a prefill chunk's rows whose queries the backend keeps.
        Returns the row of the first token."""
        bs, n, offset = self.block_size, len(tokens), len(self.input_ids)
        self.input_ids.extend(tokens)
        if tree:
            self.positions.extend([start, *(start + d for d in draft_tree.depths(tree))])
        else:
            self.positions.extend(range(start, start + n))
        window, dropped = (seq.kv_window, seq.cache_offset) if seq is not None else (None, 0)
        start -= dropped
        self.slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
        if kind == "decode":
            self.decode_lens.append(start + 1)
            self.decode_tables.append(tuple(blocks))
        else:
            (self.verifies if kind == "verify" else self.prefills).append(
                PrefillSpan(offset, n, start + n, tuple(blocks), tuple(tree), window, dropped, capture))
        return offset

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        batch = AttentionBatch(
            num_decode=len(self.decode_lens), decode_context_lens=tuple(self.decode_lens),
            decode_block_tables=tuple(self.decode_tables), prefills=tuple(self.prefills),
            verifies=tuple(self.verifies),
            slot_mapping=torch.tensor(self.slots, dtype=torch.long, device=self.device),
            block_size=self.block_size)
        return (torch.tensor(self.input_ids, dtype=torch.long, device=self.device),
                torch.tensor(self.positions, dtype=torch.long, device=self.device), batch)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_arena: torch.Tensor, backend: AttentionBackend,
                 block_size: int, device: torch.device, hidden_hook: HiddenHook | None = None,
                 hidden_layers: tuple[int, ...] = (), graphs=None, step_sender: StepSender | None = None,
                 balancer: ExpertBalancer | None = None):
        self.model = model
        self.kv_arena = kv_arena
        self.backend = backend
        self.block_size = block_size
        self.device = device
        # hidden_hook(plan, input_ids, positions, hidden, meta): the target's pre-norm hidden states
        # of every token of the step (a speculator's pass over them); None: the model returns none.
        self.hidden_hook = hidden_hook
        self.hidden_layers = hidden_layers   # the hook's layers (outputs side by side); (): the last's
        self.graphs = graphs     # DecodeGraphs: pure-decode steps replayed from static buffers, or None
        # Tensor parallel rank 0: each pass's inputs go to the other ranks first (they run it too).
        self.step_sender = step_sender
        # Expert parallelism with --enable-eplb: experts moved between the ranks between two passes.
        self.balancer = balancer

    def _forward(self, ids_t: torch.Tensor, pos_t: torch.Tensor, batch: AttentionBatch, rows: list[int], **kw):
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.step_sender is not None:
            self.step_sender.send(StepMessage(ids_t, pos_t, batch, rows_t))
        return self.model(ids_t, pos_t, self.kv_arena, self.backend, self.backend.prepare(batch), rows_t, **kw)

    def execute(self, plan: StepPlan) -> ForwardOutput:
        """The plan's forward pass: its logits rows and the sequences they belong to (see `ForwardOutput`)."""
        if self.balancer is not None:
            self.balancer.between_steps()
        prompt_rows = [c for c in plan.chunks if c.seq.wants_prompt_logprobs and not c.draft]
        if self.graphs is not None and self.hidden_hook is None and not prompt_rows:
            bucket = self.graphs.bucket_for(plan)
            if bucket is not None:
                return ForwardOutput(*self.graphs.run(plan, bucket))
        layout = BatchLayout(self.block_size, self.device)
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        offsets: dict[Sequence, int] = {}
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            if chunk.draft:
                offset = layout.add([seq.token_ids[start], *chunk.draft], start, seq.block_ids, "verify", chunk.tree)
                logits_rows.extend(range(offset, offset + n))
                sampled.append(seq)
                continue
            capture = self._capture(seq, start, n)
            offset = layout.add(seq.token_ids[start:start + n], start, seq.block_ids,
                                "decode" if n == 1 and capture is None else "prefill", seq=seq, capture=capture)
            offsets[seq] = offset
            if chunk.samples:
                logits_rows.append(offset + n - 1)
                sampled.append(seq)
        num_sampled = len(logits_rows)
        spans = []
        for chunk in prompt_rows:
            # The row at position p scores prompt token p + 1; positions already scored are skipped
            # (a request recomputed after preemption).
            first = max(chunk.start, len(chunk.seq.prompt_logprobs))
            last = min(chunk.start + chunk.num_tokens, chunk.seq.num_prompt_tokens - 1)
            if first < last:
                base = offsets[chunk.seq] - chunk.start
                spans.append((chunk.seq, first, len(logits_rows), last - first))
                logits_rows.extend(range(base + first, base + last))
        ids_t, pos_t, batch = layout.tensors()
        if self.hidden_hook is not None:
            meta = self.backend.prepare(batch)
            out = self.model(ids_t, pos_t, self.kv_arena, self.backend, meta,
                             torch.tensor(logits_rows, dtype=torch.long, device=self.device),
                             return_hidden=True, hidden_layers=self.hidden_layers)
        else:
            out = self._forward(ids_t, pos_t, batch, logits_rows)
        logits, hidden = out if self.hidden_hook is not None else (out, None)
        prompt_logits = tuple(PromptLogits(seq, first, logits[row:row + n]) for seq, first, row, n in spans)
        if self.hidden_hook is not None:
            self.hidden_hook(plan, ids_t, pos_t, hidden, meta)
        return ForwardOutput(logits[:num_sampled] if spans else logits, sampled, prompt_logits)

    @staticmethod
    def _capture(seq: Sequence, start: int, n: int) -> QueryCapture | None:
        """Where a compacting prompt's chunk puts its observed queries (a list on the sequence)."""
        rows = Compactor.capture_rows(seq, start, n)
        if rows is None:
            return None
        seq.captured.append([])
        return QueryCapture(seq.captured[-1], *rows)

    def run_spans(self, spans: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """A forward pass outside the scheduler (a draft model's own steps): each span is
        (tokens, first position, block ids); returns fp32 logits of each span's last token."""
        layout = BatchLayout(self.block_size, self.device)
        rows = [0] * len(spans)
        for i in sorted(range(len(spans)), key=lambda i: len(spans[i][0]) > 1):   # decodes first
            tokens, start, blocks = spans[i]
            rows[i] = layout.add(tokens, start, blocks, "decode" if len(tokens) == 1 else "prefill") + len(tokens) - 1
        ids_t, pos_t, batch = layout.tensors()
        return self._forward(ids_t, pos_t, batch, rows)
