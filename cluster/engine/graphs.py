"""Decode steps replayed from CUDA graphs: captured once per batch bucket at start, fed by padding.

A step of B decode rows (one token per plain decode, k + 1 per verification of k draft tokens,
each a row of its own; no prefill chunk) runs the graph of the smallest bucket Bp >= B of the kernel
plan's ladder (`BatchBuckets`, up to max_num_seqs rows, times the widest verification with
speculation). Every input the graph reads is a static buffer written in place before the replay:
token ids, positions, KV slots, block tables and context lengths. The Bp - B pad rows decode token
0 at position 0 into a pad block that belongs to no sequence (one block past the pool's, never
allocated), attending only that block, so they cannot touch a real sequence's KV; their logits are
dropped. Prefill, EAGLE and steps with more rows than the last bucket run
eagerly. A draft model's passes after its catch-up (one token per sequence) replay
their own graphs the same way (decode/spec/draft_model.py).

What can be wrong without a GPU, the padding, the static buffers and their meta, sits in front of
a `Replay`: `CudaGraphReplay` captures on CUDA, `EagerReplay` runs the same callable eagerly on the
same static buffers (the CPU tests' stand-in, and what `cuda_graphs="on"` means on a CPU).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from cluster.engine.scheduler import StepPlan
from cluster.engine.sequence import Sequence

log = logging.getLogger(__name__)


class Replay(Protocol):
    def __call__(self) -> torch.Tensor:
        """Run the captured step on the current contents of the static buffers; its logits."""


class EagerReplay:
    def __init__(self, fn: Callable[[], torch.Tensor], pool=None):
        self.fn = fn

    def __call__(self) -> torch.Tensor:
        return self.fn()


class CudaGraphReplay:
    """One CUDA graph of `fn`, captured after two warm-up runs on a side stream (which also run
    Triton's autotuning for the bucket's shapes, outside the capture)."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool=None):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn()

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class DecodeBucket:
    """The static buffers of one bucket of `size` rows (and the backend's meta over them)."""

    def __init__(self, size: int, width: int, pad_block: int, block_size: int, device: torch.device,
                 table_dtype: torch.dtype):
        self.size = size
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), self.pad_slot, dtype=torch.long, device=device)
        self.tables = torch.full((size, width), pad_block, dtype=table_dtype, device=device)
        self.lens = torch.ones(size, dtype=table_dtype, device=device)
        self.logits_rows = torch.arange(size, device=device)
        self.replay: Replay | None = None
        self.meta = None

    def fill(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
             lens: list[int]) -> None:
        """The step's B rows into the buffers, rows B.. as pad rows (a copy each, from one host
        tensor per buffer)."""
        pad = self.size - len(ids)
        width = self.tables.shape[1]
        rows = [[*t, *(self.pad_block,) * (width - len(t))] for t in tables] + [[self.pad_block] * width] * pad
        self.input_ids.copy_(torch.tensor([*ids, *(0,) * pad], dtype=torch.long), non_blocking=True)
        self.positions.copy_(torch.tensor([*positions, *(0,) * pad], dtype=torch.long), non_blocking=True)
        self.slots.copy_(torch.tensor([*slots, *(self.pad_slot,) * pad], dtype=torch.long), non_blocking=True)
        self.tables.copy_(torch.tensor(rows, dtype=self.tables.dtype), non_blocking=True)
        self.lens.copy_(torch.tensor([*lens, *(1,) * pad], dtype=self.lens.dtype), non_blocking=True)


TUNE_CONTEXT = 4096   # keys each row attends in the capture's warm-up runs


def _decode_step(model, arena: torch.Tensor, backend, bucket: DecodeBucket) -> torch.Tensor:
    """One decode pass over `bucket`'s static buffers: what a replay runs (or captures)."""
    return model(bucket.input_ids, bucket.positions, arena, backend, bucket.meta, bucket.logits_rows)


class DecodeGraphs:
    """One replay per bucket size, built at start (largest first: they share CUDA's graph pool)."""

    def __init__(self, model, arena: torch.Tensor, backend, block_size: int, device: torch.device,
                 sizes: list[int], width: int, pad_block: int, replay_factory):
        self.block_size = block_size
        self.width = width
        self.sizes = sorted(sizes)
        self.buckets: dict[int, DecodeBucket] = {}
        self.replays = 0
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        # The capture's warm-up runs are where Triton autotunes decode: rows of pad length 1 would
        # tune for launch overhead. They attend TUNE_CONTEXT keys (all in the pad block) instead.
        self.tune_context = min(TUNE_CONTEXT, width * block_size)
        for size in reversed(self.sizes):
            bucket = DecodeBucket(size, width, pad_block, block_size, device, backend.table_dtype)
            bucket.meta = backend.static_decode_meta(bucket.slots, bucket.tables, bucket.lens, width * block_size)
            bucket.lens.fill_(self.tune_context)
            bucket.replay = replay_factory(functools.partial(_decode_step, model, arena, backend, bucket), pool)
            bucket.lens.fill_(1)   # pad rows again
            self.buckets[size] = bucket
        log.info("decode graphs for batch sizes %s (%s)", self.sizes, replay_factory.__name__)

    def fits(self, rows: int) -> DecodeBucket | None:
        """The smallest bucket that holds `rows` rows, or None above the last one."""
        size = next((s for s in self.sizes if s >= rows), None)
        return None if size is None else self.buckets[size]

    def bucket_for(self, plan: StepPlan) -> DecodeBucket | None:
        """A step of decodes and verifications (no prefill chunk) fits by its number of rows."""
        if plan.prefills or not (plan.decodes or plan.verifies):
            return None
        if any(c.draft or not c.samples for c in plan.decodes) or any(c.tree for c in plan.verifies):
            return None   # a token tree's rows read their ancestors' slots: the eager path's tails
        if any(c.seq.reindexed for c in plan.decodes):
            return None   # a windowed or compacted table's positions differ from its cache indices
        return self.fits(len(plan.decodes) + sum(1 + len(c.draft) for c in plan.verifies))

    def run(self, plan: StepPlan, bucket: DecodeBucket) -> tuple[torch.Tensor, list[Sequence]]:
        """Every verified token is a decode row of its own at its position (its K/V, like every
        row's, is stored before any row attends), so a verification reads what plain decoding of
        the same tokens would; rows in the order ModelRunner.execute returns them."""
        rows = [(c.seq.token_ids[c.start], c.start, c.seq.block_ids) for c in plan.decodes]
        for c in plan.verifies:
            tokens = [c.seq.token_ids[c.start], *c.draft]
            rows += [(t, c.start + j, c.seq.block_ids) for j, t in enumerate(tokens)]
        return self.run_rows(rows, bucket), [c.seq for c in (*plan.decodes, *plan.verifies)]

    def run_rows(self, rows: list[tuple[int, int, list[int]]], bucket: DecodeBucket) -> torch.Tensor:
        """Logits of decode rows (token, position, the sequence's block ids) through `bucket`."""
        bs = self.block_size
        ids, positions, slots, tables, lens = [], [], [], [], []
        for token, p, blocks in rows:
            if p // bs >= self.width:
                raise ValueError(f"position {p} is past the decode graphs' {self.width} blocks")
            ids.append(token)
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            tables.append(blocks[:p // bs + 1])
            lens.append(p + 1)
        bucket.fill(ids, positions, slots, tables, lens)
        self.replays += 1
        return bucket.replay()[:len(rows)]


def replay_factory(device: torch.device, mode: str):
    """The replay for `mode` ("auto", "on", "off") on `device`, or None for no decode graphs:
    "auto" captures CUDA graphs on CUDA and runs eagerly elsewhere; "on" on a CPU runs the static-
    buffer path with eager replays (what the CPU tests exercise). `mode` is checked by EngineConfig."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    return CudaGraphReplay if device.type == "cuda" else EagerReplay
