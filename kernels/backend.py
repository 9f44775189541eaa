"""TritonAttentionBackend: the engine's AttentionBackend protocol on the Triton kernels.

`prepare` runs once per step on the host: it reads the step's AttentionBatch by attribute (kernels
is a leaf package and never imports cluster), packs every block table, length and tile map into
ONE int32 tensor (one host-to-device copy per step), and picks the split-KV partition. `forward`
runs per layer with no host work beyond slicing: store_kv, then one launch per section of the
flat batch, which is laid out as decodes, then verification spans, then prefill spans.

Batch-invariant mode (`invariant=True`): every token of the step, whatever its kind, is a decode
row of its own over its prefix (context = its position + 1), in one decode section with a fixed
partition and config. A position's attention is then the same arithmetic however its token was
batched, chunked or verified. A step that verifies a token tree is laid out the same way (with
the step's own partition outside the invariant mode): a tree row reads its path's keys from an
explicit list of slots (`tails`), in the tiles a plain decode row of the same tokens would use.

Quantized KV caches (`--kv-cache-dtype int8|fp8_e4m3`: int8/uint8 rows of D values + an fp16
scale, kernels/kv_quant.py) need nothing here: each kernel reads the kind from the cache's dtype,
store_kv quantizes the step's rows and the attention kernels dequantize in registers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._common import head_block, interpreting
from kernels.decode import (INVARIANT_PARTITION, MAX_ROWS, default_partition, paged_decode_attention,
                            paged_verify_attention)
from kernels.mla_triton import mla_decode_triton
from kernels.prefill import block_m_for, prefill_attention, prefill_tiles
from kernels.rows import every_token_rows
from kernels.store_kv import store_kv


@dataclass
class _Section:
    kind: str                     # "decode", "verify" or "prefill": which kernel runs it
    first_row: int                # its rows in the flat batch: first_row .. first_row + num_rows
    num_rows: int
    tables: torch.Tensor          # [n, max_blocks] int32 views into the step's one int tensor
    ctx_lens: torch.Tensor        # [n]
    q_starts: torch.Tensor        # [n], relative to first_row
    q_lens: torch.Tensor          # [n]
    max_query_len: int
    max_context: int
    partition: int | None = None  # split-KV partition (decode/verify)
    workspace: tuple | None = None
    tiles: torch.Tensor | None = None   # prefill tile map [tiles, 2]
    block_m: int | None = None          # the rows per tile it was cut for
    tails: torch.Tensor | None = None   # decode rows of token trees: [n, 1 + W] (kernels/rows.py tree_tails)


@dataclass
class TritonMeta:
    slot_mapping: torch.Tensor
    sections: list


class TritonAttentionBackend:
    name = "triton"
    table_dtype = torch.int32   # of the tables and lengths the kernels read
    verifies_trees = True       # token-tree verifications: every row a decode row, tree rows with tails
    # Latent attention's (MLA) absorbed decode, for cluster/model/mla_engine.py (kernels/mla_triton.py).
    mla_decode = staticmethod(mla_decode_triton)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 partition_size: int | None = None, invariant: bool = False, dtype: torch.dtype | None = None,
                 scale: float | None = None):
        device = torch.device(device)
        # "meta" plans launches without running them (kernels/compile_check.py records them).
        if device.type not in ("cuda", "meta") and not interpreting():
            raise ValueError(f"the triton attention backend runs on CUDA devices, not {device.type} "
                             "(TRITON_INTERPRET=1 runs it on CPU, slowly, for tests)")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale   # the softmax scale (a runtime argument)
        self.device = device
        self.partition_size = partition_size   # None: chosen per step for the device
        self.invariant = invariant
        self.block_m = block_m_for(head_dim, dtype)   # prefill tiles: smaller for fp32 (`dtype`, the cache's)
        if invariant and self.group > MAX_ROWS:
            raise ValueError(f"batch-invariant attention holds at most {MAX_ROWS} query heads per KV head")

    def prepare(self, batch) -> TritonMeta:
        # A token tree's rows read their path's slots: every token a decode row of its own, as in
        # the invariant mode (a step with a tree is short: decodes and verifications, rarely a chunk).
        if self.invariant or any(getattr(s, "tree", ()) for s in batch.verifies):
            return self._prepare_every_row(batch)
        bs = batch.block_size
        groups = _span_groups(batch)
        seqs = [s for _, spans in groups for s in spans]
        if not seqs:
            return TritonMeta(batch.slot_mapping, [])
        width = max(-(-ctx // bs) for _, _, ctx, _ in seqs)
        ints: list[int] = []
        for _, _, ctx, table in seqs:
            row = list(table[:-(-ctx // bs)])
            ints += row + [0] * (width - len(row))
        num = len(seqs)
        heads = [len(ints), len(ints) + num, len(ints) + 2 * num]   # offsets of ctx, q_start, q_len
        firsts = [spans[0][0] for _, spans in groups]
        ints += [ctx for _, _, ctx, _ in seqs]
        ints += [s[0] - first for (_, spans), first in zip(groups, firsts) for s in spans]
        ints += [s[1] for s in seqs]
        plans, tile_lists = [], []
        for kind, spans in groups:
            max_q = max(s[1] for s in spans)
            if kind != "prefill" and max_q * self.group > MAX_ROWS:
                kind = "prefill"   # too many packed rows for one split-KV program
            plans.append((kind, max_q))
            if kind == "prefill":
                tiles = prefill_tiles([s[1] for s in spans], [s[2] for s in spans], self.group, self.block_m)
                tile_lists.append((len(ints), len(tiles)))
                ints += [x for tile in tiles for x in tile]
            else:
                tile_lists.append(None)
        flat = torch.tensor(ints, dtype=torch.int32).to(self.device, non_blocking=True)
        table = flat[:num * width].view(num, width)
        sections, lo = [], 0
        for (kind, spans), first, (run_as, max_q), tl_ in zip(groups, firsts, plans, tile_lists):
            hi = lo + len(spans)
            sec = _Section(
                kind=run_as, first_row=first, num_rows=sum(s[1] for s in spans), tables=table[lo:hi],
                ctx_lens=flat[heads[0] + lo:heads[0] + hi], q_starts=flat[heads[1] + lo:heads[1] + hi],
                q_lens=flat[heads[2] + lo:heads[2] + hi], max_query_len=max_q,
                max_context=max(s[2] for s in spans))
            if tl_ is not None:
                sec.tiles = flat[tl_[0]:tl_[0] + 2 * tl_[1]].view(-1, 2)
                sec.block_m = self.block_m
            else:
                self._plan_split(sec, len(spans))
            sections.append(sec)
            lo = hi
        return TritonMeta(batch.slot_mapping, sections)

    def _prepare_every_row(self, batch) -> TritonMeta:
        """Invariant mode: one decode section of every token in flat order, each with its own
        context length and its sequence's block table, split by a partition that never follows
        the step (the constructor's, else INVARIANT_PARTITION)."""
        if not batch.slot_mapping.numel():
            return TritonMeta(batch.slot_mapping, [])
        tables, lens, max_context, tails = every_token_rows(batch, torch.int32)
        row, width = tables.shape
        parts = [tables.reshape(-1), lens, *(() if tails is None else (tails.reshape(-1),))]
        flat = torch.cat(parts).to(self.device, non_blocking=True)
        ctx_lens = flat[row * width:row * (width + 1)]
        sec = self._decode_section(flat[:row * width].view(row, width), ctx_lens, max_context)
        if tails is not None:
            sec.tails = flat[row * (width + 1):].view(row, -1)
        return TritonMeta(batch.slot_mapping, [sec])

    def static_decode_ready(self) -> bool:
        return True

    def static_decode_meta(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                           max_context: int) -> TritonMeta:
        """A decode step's meta over static buffers (CUDA-graph decode, cluster/engine/graphs.py):
        one row per sequence, the partition and workspace sized for `max_context`, so every
        replay launches the same grid whatever the contexts it is fed."""
        return TritonMeta(slots, [self._decode_section(tables, lens, max_context)])

    def _decode_section(self, tables: torch.Tensor, ctx_lens: torch.Tensor, max_context: int) -> _Section:
        rows = tables.shape[0]
        sec = _Section(kind="decode", first_row=0, num_rows=rows, tables=tables, ctx_lens=ctx_lens, q_starts=ctx_lens,
                       q_lens=ctx_lens, max_query_len=1, max_context=max_context)
        if self.invariant:   # always split, by a partition that never follows the step
            self._set_partition(sec, self.partition_size or INVARIANT_PARTITION)
        else:
            self._plan_split(sec, rows)
        return sec

    def _plan_split(self, sec: _Section, num_seqs: int) -> None:
        part = self.partition_size
        if part is None:
            part = default_partition(sec.max_context, num_seqs, self.num_kv_heads, self.device)
        if part is None or part >= sec.max_context:
            return
        self._set_partition(sec, part)

    def _set_partition(self, sec: _Section, part: int) -> None:
        sec.partition = part
        # Partial outputs live for the whole step: every layer reuses them in stream order.
        need = sec.num_rows * self.num_heads * -(-sec.max_context // part)
        sec.workspace = (torch.empty(need * head_block(self.head_dim), dtype=torch.float32, device=self.device),
                         torch.empty(need, dtype=torch.float32, device=self.device))

    def forward(self, q, k, v, k_cache, v_cache, window, meta: TritonMeta, store: bool = True) -> torch.Tensor:
        if store:   # False: a layer attending another layer's cache (cross-layer KV sharing)
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens = q.shape[0]
        out = torch.empty((num_tokens, self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        for s in meta.sections:
            rows = slice(s.first_row, s.first_row + s.num_rows)
            if s.kind == "decode":
                paged_decode_attention(q[rows], k_cache, v_cache, s.tables, s.ctx_lens, self.scale, window,
                                       s.max_context, s.partition, out[rows], s.workspace, self.invariant, s.tails)
            elif s.kind == "verify":
                paged_verify_attention(q[rows], k_cache, v_cache, s.tables, s.q_starts, s.q_lens, s.ctx_lens,
                                       s.max_query_len, self.scale, window, s.max_context, s.partition, out[rows],
                                       s.workspace)
            else:
                prefill_attention(q[rows], k_cache, v_cache, s.tables, s.q_starts, s.q_lens, s.ctx_lens,
                                  s.max_query_len, self.scale, window, s.tiles, out[rows], s.block_m)
        return out.view(num_tokens, -1)


def _span_groups(batch) -> list[tuple[str, list[tuple]]]:
    """Every sequence of the batch as (query start, query len, context len, block table), grouped
    by kind (decode, verify, prefill) in the batch's flat order."""
    groups = []
    if batch.num_decode:
        groups.append(("decode", [(i, 1, n, t) for i, (n, t) in
                                  enumerate(zip(batch.decode_context_lens, batch.decode_block_tables))]))
    for kind, spans in (("verify", batch.verifies), ("prefill", batch.prefills)):
        if spans:
            groups.append((kind, [(s.query_start, s.query_len, s.context_len, s.block_table) for s in spans]))
    return groups
