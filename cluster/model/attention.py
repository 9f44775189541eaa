"""Attention over the paged KV cache behind a small backend interface.

A step's batch is laid out as one flat run of tokens: first the decode sequences (one query
token each), then the speculative verifications (k+1 query tokens each, the last accepted token
and k draft tokens, after the sequence's cached context; k differs per sequence), then the
prefill chunks (several query tokens each, possibly after a cached prefix). `AttentionBatch` describes that layout once per step; each backend turns it into
whatever metadata it needs (`prepare`) and then runs every layer with it (`forward`).

The torch reference here is what runs on CPU; Triton kernels plug in behind the same protocol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cluster.kv.kv_quant import cache_kind, dequantize_rows, quantize_rows
from cluster.kv.compaction import QueryCapture
from cluster.kv.window import KVWindow
from cluster.model.kernel_plan import AttentionPath, KernelPlan
from kernels import cpu_ops
from kernels.rows import every_token_rows, tails_tensor, tree_depths, tree_path, tree_tails


@dataclass(frozen=True)
class PrefillSpan:
    query_start: int     # offset of the chunk's first token in the flat batch
    query_len: int
    context_len: int     # tokens in the cache after this chunk (cached prefix + chunk)
    block_table: tuple[int, ...]
    # A verification's token tree (cluster/engine/draft_tree.py): the drafts' parents; () a chain.
    # Its tokens sit at slots start.. in order but at positions start + depth.
    tree: tuple[int, ...] = ()
    # A windowed sequence's chunk (cluster/kv/window.py): its table holds the live blocks only,
    # `dropped` tokens freed past the sinks; each query sees its own window (a mask).
    kv_window: KVWindow | None = None
    dropped: int = 0
    capture: QueryCapture | None = None   # a compacting prompt's observed queries (each layer keeps its own)


@dataclass(frozen=True)
class AttentionBatch:
    num_decode: int
    decode_context_lens: tuple[int, ...]
    decode_block_tables: tuple[tuple[int, ...], ...]
    prefills: tuple[PrefillSpan, ...]
    slot_mapping: torch.Tensor   # [num_tokens] flat cache slot of every token (long)
    block_size: int
    verifies: tuple[PrefillSpan, ...] = ()   # short spans, causal among themselves, batched together


class AttentionBackend(Protocol):
    name: str
    verifies_trees: bool    # token-tree verifications (PrefillSpan.tree): a speculator may grow trees

    def prepare(self, batch: AttentionBatch) -> Any:
        """Build per-step metadata shared by all layers."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None,
                meta: Any, store: bool = True) -> torch.Tensor:
        """Store k/v at the batch's slots, then attend. q: [T, Hq, D]; k, v: [T, Hkv, D];
        caches: [num_blocks, block_size, Hkv, D]. Returns [T, Hq * D]. `store` False: k/v are
        in the caches already (a layer attending another layer's K/V: cross-layer KV sharing);
        None in a pure decode pass, whose attention reads the caches alone."""


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, valid: torch.Tensor,
                 window: int | None) -> torch.Tensor:
    allowed = valid & (key_pos <= query_pos)
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed


@dataclass
class _TorchDecodeMeta:
    block_table: torch.Tensor     # [B * max_blocks] block ids, padded with block 0
    lens: torch.Tensor            # [B] context lengths (int64)
    fused: bool                   # the kernel plan's fused C kernel, not gather + SDPA
    key_pos: torch.Tensor | None  # [1, L] with L = max_blocks * block_size (SDPA only)
    query_pos: torch.Tensor       # [B, 1] ([B] on the fused path: only its length is read)
    valid: torch.Tensor | None    # [B, L] (SDPA only)
    masks: dict                   # (window, dtype) -> additive [B, 1, 1, L]
    tails: torch.Tensor | None = None   # token-tree rows' last keys (kernels/rows.py tree_tails), fused only


@dataclass
class _TorchPrefillMeta:
    span: PrefillSpan
    gather: torch.Tensor | None   # [context_len] flat slots; None when there is no cached prefix
    masks: dict                   # (window, dtype) -> additive [q, ctx]
    block_size: int = 0
    kv_mask: torch.Tensor | None = None   # a windowed chunk's own [q, ctx] bool mask (PrefillSpan.kv_window)


@dataclass
class _TorchVerifyMeta:
    block_table: torch.Tensor     # [B * max_blocks]
    query_rows: torch.Tensor      # [B * Q] flat-batch row of each padded query (pads repeat a real row)
    out_rows: torch.Tensor        # [n] padded-query index of each real verify token, in flat order
    first_row: int                # flat row of the first verify token (verify tokens are contiguous)
    num_rows: int
    query_pos: torch.Tensor       # [B, Q, 1]
    key_pos: torch.Tensor         # [B, 1, L] each key slot's position (a tree's drafts: start + depth); [1, 1, L] without trees
    valid: torch.Tensor           # [B, Q, L] in the context and on the query's path for a tree's keys; [B, 1, L] without trees
    masks: dict
    fused_tables: torch.Tensor | None = None   # fused C kernel: [rows, max_blocks], one row per query
    fused_lens: torch.Tensor | None = None     # [rows]: each query's position + 1
    fused_tails: torch.Tensor | None = None    # [rows, 1 + W]: token-tree rows' last keys (None: no tree)


@dataclass
class _TorchMeta:
    slot_mapping: torch.Tensor
    decode: _TorchDecodeMeta | None
    prefills: list
    verify: _TorchVerifyMeta | None = None


class TorchAttentionBackend:
    """Reference attention: gathers each sequence's blocks and calls SDPA."""

    name = "torch"
    table_dtype = torch.long   # of the tables and lengths the C kernel reads
    verifies_trees = True      # token-tree verifications (PrefillSpan.tree): tails in the C kernel, masks in SDPA

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 plan: KernelPlan | None = None, scale: float | None = None, int4_view: bool = False):
        self.plan = plan          # its decode_attention choice, per bucket of decode rows
        # Reads an int8 cache through its int4 view (QuantSpec's draft over the target's cache);
        # what it stores is plain int8 either way.
        self.int4_view = int4_view
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale   # the softmax scale (ModelConfig.attention_scale)
        self.device = device

    def prepare(self, batch: AttentionBatch) -> _TorchMeta:
        if self.plan is not None and self.plan.batch_invariant:
            return _TorchMeta(slot_mapping=batch.slot_mapping, decode=self._prepare_every_row(batch), prefills=[])
        decode = self._prepare_decode(batch) if batch.num_decode else None
        prefills = [self._prepare_prefill(span, batch.block_size) for span in batch.prefills]
        verify = self._prepare_verify(batch.verifies, batch.block_size) if batch.verifies else None
        return _TorchMeta(slot_mapping=batch.slot_mapping, decode=decode, prefills=prefills, verify=verify)

    def static_decode_meta(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                           max_context: int) -> _TorchMeta:
        """A decode step's meta over static buffers (decode graphs, cluster/engine/graphs.py): the
        fused C kernel reads tables and lengths in place, whatever their contents."""
        if not self.static_decode_ready():
            raise ValueError("decode graphs on the torch backend need the fused C decode kernel "
                             "(a kernel plan with decode attention fused_c; not --kernels torch)")
        return _TorchMeta(slot_mapping=slots, prefills=[], decode=_TorchDecodeMeta(
            block_table=tables.view(-1), lens=lens, fused=True, key_pos=None, query_pos=lens, valid=None, masks={}))

    def static_decode_ready(self) -> bool:
        return self.device.type == "cpu" and (self._fused() or (self.plan is not None and self.plan.batch_invariant))

    def fused_block_ready(self, meta: _TorchMeta) -> bool:
        """A pure-decode pass on the fused kernel: each layer's RoPE, K/V store and attention can
        run as one C call (`decode_block`)."""
        return (meta.decode is not None and meta.decode.fused and not meta.prefills and meta.verify is None
                and meta.decode.tails is None and cpu_ops.has_decode_block())

    def decode_block(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, k_cache, v_cache, window,
                     meta: _TorchMeta) -> torch.Tensor:
        dm = meta.decode
        b = qkv.shape[0]
        return cpu_ops.decode_block(qkv, positions, rotary.cos, rotary.sin, meta.slot_mapping, k_cache, v_cache,
                                    dm.block_table.view(b, -1), dm.lens, self.num_heads, self.num_kv_heads,
                                    self.head_dim, window, self.scale, self.int4_view)

    def _c_prefill(self, q, k, v) -> bool:
        """The plan's C prefill kernel, for the layouts it reads: heads and dims contiguous in
        each row, a head dim of whole vectors."""
        if self.plan is None or self.plan.prefill_attention is not AttentionPath.FUSED_C:
            return False
        return (self.head_dim % 16 == 0 and self.head_dim <= 256 and cpu_ops.supports(q.dtype)
                and all(t.stride(2) == 1 and t.stride(1) == self.head_dim for t in (q, k, v)))

    def _fused(self) -> bool:
        return self.plan is not None and self.plan.decode_attention is AttentionPath.FUSED_C

    def _prepare_verify(self, spans: tuple[PrefillSpan, ...], bs: int) -> _TorchVerifyMeta:
        b = len(spans)
        width = max(s.query_len for s in spans)
        max_blocks = -(-max(s.context_len for s in spans) // bs)
        table = torch.zeros((b, max_blocks), dtype=torch.long)
        query_rows, out_rows, query_pos = [], [], []
        # Per span, each key slot's position and which queries see it (a token tree's drafts sit at
        # slots past the pending token's but at the positions of their depths, and see their path only).
        trees = any(s.tree for s in spans)
        key_pos = torch.arange(max_blocks * bs, dtype=torch.long).repeat(b if trees else 1, 1)
        sees = torch.ones((b, width, max_blocks * bs) if trees else (1, 1, 1), dtype=torch.bool)
        for i, s in enumerate(spans):
            n = -(-s.context_len // bs)
            table[i, :n] = torch.tensor(s.block_table[:n], dtype=torch.long)
            first_pos = s.context_len - s.query_len
            offsets = list(range(s.query_len))
            if s.tree:
                offsets = [0, *tree_depths(s.tree)]
                key_pos[i, first_pos + 1:s.context_len] = first_pos + torch.tensor(offsets[1:])
                sees[i, :, first_pos + 1:s.context_len] = False
                for node in range(len(s.tree)):
                    sees[i, node + 1, [first_pos + 1 + j for j in tree_path(s.tree, node)]] = True
            for r in range(width):
                real = r < s.query_len
                query_rows.append(s.query_start + (r if real else s.query_len - 1))
                query_pos.append(first_pos + offsets[r if real else s.query_len - 1])
                if real:
                    out_rows.append(i * width + r)
        lens = torch.tensor([s.context_len for s in spans], dtype=torch.long)
        dev = self.device
        fused_tables = fused_lens = fused_tails = None
        if self._fused():
            # Each draft query is a decode row of its own: the same kernel and the same arithmetic
            # as plain decoding at that position, so verification agrees with it bit for bit.
            per_span = torch.tensor([s.query_len for s in spans])
            fused_tables = table.repeat_interleave(per_span, dim=0)
            fused_lens = torch.tensor([query_pos[i * width + r] + 1 for i, s in enumerate(spans)
                                       for r in range(s.query_len)], dtype=torch.long)
            if trees:
                fused_tails = tails_tensor([t for s, row in zip(spans, table.tolist()) for t in (
                    tree_tails(s.context_len - s.query_len, s.tree, row, bs) if s.tree else [[0]] * s.query_len)])
        valid = (torch.arange(max_blocks * bs)[None, :] < lens[:, None])[:, None, :] & sees
        return _TorchVerifyMeta(
            fused_tables=fused_tables, fused_lens=fused_lens, fused_tails=fused_tails,
            block_table=table.view(-1).to(dev), query_rows=torch.tensor(query_rows, device=dev),
            out_rows=torch.tensor(out_rows, device=dev), first_row=spans[0].query_start,
            num_rows=sum(s.query_len for s in spans),
            query_pos=torch.tensor(query_pos, dtype=torch.long).view(b, width, 1).to(dev),
            key_pos=key_pos[:, None, :].to(dev), valid=valid.to(dev), masks={})

    def _prepare_every_row(self, batch: AttentionBatch) -> _TorchDecodeMeta:
        """Batch-invariant mode: every token of the pass (decode, verification, prefill chunk) as
        a decode row of its own, attending its own prefix through the fused C kernel, so a
        position's attention is the same arithmetic however the token was batched or chunked.
        The pass then runs as a pure decode pass (RoPE, K/V store and attention in one call per
        layer: each row's own K/V is stored before any row attends)."""
        tables, lens_t, _, tails = every_token_rows(batch)
        return _TorchDecodeMeta(block_table=tables.reshape(-1), lens=lens_t, fused=True, key_pos=None,
                                query_pos=lens_t, valid=None, masks={}, tails=tails)

    def _slots(self, block_table: tuple[int, ...], length: int, block_size: int) -> torch.Tensor:
        blocks = torch.tensor(block_table, dtype=torch.long)
        offsets = torch.arange(block_size, dtype=torch.long)
        return (blocks[:, None] * block_size + offsets).reshape(-1)[:length]

    def _prepare_decode(self, batch: AttentionBatch) -> _TorchDecodeMeta:
        bs = batch.block_size
        lens = batch.decode_context_lens
        max_blocks = -(-max(lens) // bs)
        # One tensor from one padded list (rows padded with block 0): no per-row tensor.
        rows = []
        for i, row in enumerate(batch.decode_block_tables):
            n = -(-lens[i] // bs)
            rows.extend(row[:n])
            rows.extend((0,) * (max_blocks - n))
        table = torch.tensor(rows, dtype=torch.long).view(len(lens), max_blocks)
        lens_t = torch.tensor(lens, dtype=torch.long)
        if self._fused():   # the C kernel reads tables and lengths only: no positions, no masks
            return _TorchDecodeMeta(block_table=table.view(-1), lens=lens_t, fused=True, key_pos=None,
                                    query_pos=lens_t, valid=None, masks={})
        key_pos = torch.arange(max_blocks * bs, dtype=torch.long)[None, :]
        return _TorchDecodeMeta(
            block_table=table.view(-1).to(self.device), lens=lens_t, fused=self._fused(), key_pos=key_pos.to(self.device),
            query_pos=(lens_t - 1)[:, None].to(self.device),
            valid=(key_pos < lens_t[:, None]).to(self.device), masks={})

    def _prepare_prefill(self, span: PrefillSpan, block_size: int) -> _TorchPrefillMeta:
        cached = span.context_len - span.query_len
        gather = None
        if cached:
            gather = self._slots(span.block_table, span.context_len, block_size).to(self.device)
        return _TorchPrefillMeta(span=span, gather=gather, masks={}, block_size=block_size,
                                 kv_mask=None if span.kv_window is None else span.kv_window.span_mask(
                                     span.query_len, span.context_len, span.dropped, self.device))

    def forward(self, q, k, v, k_cache, v_cache, window, meta: _TorchMeta, store: bool = True) -> torch.Tensor:
        num_tokens = q.shape[0]
        k_flat = k_cache.view(-1, self.num_kv_heads, k_cache.shape[-1])   # D, or D + 2 for quantized rows
        v_flat = v_cache.view(-1, self.num_kv_heads, v_cache.shape[-1])
        if store:
            self._store(k, v, k_cache, v_cache, k_flat, v_flat, meta.slot_mapping)
        if meta.decode is not None and not meta.prefills and meta.verify is None:   # pure decode: no scratch copy
            return self._decode(q, k_cache, v_cache, window, meta.decode).view(num_tokens, -1)
        out = torch.empty((num_tokens, self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        if meta.decode is not None:
            n = meta.decode.query_pos.shape[0]
            out[:n] = self._decode(q[:n], k_cache, v_cache, window, meta.decode)
        if meta.verify is not None:
            vm = meta.verify
            out[vm.first_row:vm.first_row + vm.num_rows] = self._verify(q, k_cache, v_cache, window, vm)
        for pm in meta.prefills:
            s = pm.span
            sl = slice(s.query_start, s.query_start + s.query_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], k_flat, v_flat, window, pm)
        return out.view(num_tokens, -1)

    def _store(self, k, v, k_cache, v_cache, k_flat, v_flat, slots) -> None:
        """The pass's K/V rows at their slots; a quantized cache quantizes them as they go in (the
        C store where the fused ops are built, the torch reference otherwise: the same bytes)."""
        kind = cache_kind(k_cache)
        c_store = self._fused() or (kind.quantized and self.device.type == "cpu" and cpu_ops.load() is not None)
        if c_store and k.stride(-1) == 1 and k.stride(-2) == self.head_dim:
            cpu_ops.store_kv(k, v, slots, k_cache, v_cache)
        elif kind.quantized:
            k_flat.index_copy_(0, slots, quantize_rows(k, kind))
            v_flat.index_copy_(0, slots, quantize_rows(v, kind))
        else:
            k_flat.index_copy_(0, slots, k)
            v_flat.index_copy_(0, slots, v)

    def _rows(self, cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` of a cache viewed as [slots or blocks, ...], dequantized to `dtype` if quantized."""
        rows = cache.index_select(0, index)
        return dequantize_rows(rows, dtype, self.int4_view) if cache_kind(cache).quantized else rows

    def _decode(self, q, k_cache, v_cache, window, dm: _TorchDecodeMeta) -> torch.Tensor:
        b = dm.query_pos.shape[0]
        if dm.fused:   # reads the paged cache in place: no gather, no mask
            return cpu_ops.decode_attention(q, k_cache, v_cache, dm.block_table.view(b, -1), dm.lens, window,
                                            self.scale, self.int4_view, dm.tails)
        length = dm.key_pos.shape[1]
        mask = dm.masks.get((window, q.dtype))
        if mask is None:
            # An additive mask in the query's dtype: SDPA on CPU runs ~2x slower with a bool mask.
            allowed = _window_mask(dm.query_pos, dm.key_pos, dm.valid, window)[:, None, None, :]
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
            dm.masks[(window, q.dtype)] = mask
        # Gather whole blocks (contiguous rows), not single slots.
        keys = self._rows(k_cache, dm.block_table, q.dtype).view(b, length, self.num_kv_heads, self.head_dim)
        vals = self._rows(v_cache, dm.block_table, q.dtype).view(b, length, self.num_kv_heads, self.head_dim)
        # All query heads of a KV group sit at the same position, so the group can ride in the
        # query-length dimension: no KV repeat, and one mask row serves every head.
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask,
                                           scale=self.scale)
        return o.reshape(b, self.num_heads, self.head_dim)

    def _verify(self, q, k_cache, v_cache, window, vm: _TorchVerifyMeta) -> torch.Tensor:
        """All verifications in one SDPA call: queries padded to the widest span, each query row
        masked by its own position (causal among the drafts, over the sequence's context)."""
        if vm.fused_tables is not None:
            rows = q[vm.first_row:vm.first_row + vm.num_rows]
            return cpu_ops.decode_attention(rows, k_cache, v_cache, vm.fused_tables, vm.fused_lens, window, self.scale,
                                            self.int4_view, vm.fused_tails)
        b, width = vm.query_pos.shape[:2]
        length = vm.key_pos.shape[-1]
        mask = vm.masks.get((window, q.dtype))
        if mask is None:
            allowed = _window_mask(vm.query_pos, vm.key_pos, vm.valid, window)        # [B, Q, L]
            allowed = allowed.repeat_interleave(self.group, dim=1)[:, None]          # [B, 1, Q*G, L]
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
            vm.masks[(window, q.dtype)] = mask
        keys = self._rows(k_cache, vm.block_table, q.dtype).view(b, length, self.num_kv_heads, self.head_dim)
        vals = self._rows(v_cache, vm.block_table, q.dtype).view(b, length, self.num_kv_heads, self.head_dim)
        qv = q.index_select(0, vm.query_rows).view(b, width, self.num_kv_heads, self.group, self.head_dim)
        qv = qv.permute(0, 2, 1, 3, 4).reshape(b, self.num_kv_heads, width * self.group, self.head_dim)
        o = F.scaled_dot_product_attention(qv, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask,
                                           scale=self.scale)
        o = o.view(b, self.num_kv_heads, width, self.group, self.head_dim).permute(0, 2, 1, 3, 4)
        return o.reshape(b * width, self.num_heads, self.head_dim).index_select(0, vm.out_rows)

    def _prefill(self, q, k, v, k_flat, v_flat, window, pm: _TorchPrefillMeta) -> torch.Tensor:
        s = pm.span
        if s.capture is not None:   # a compacting prompt's observation queries (cluster/engine/compaction.py)
            s.capture.keep(q)
        gather = pm.gather
        if gather is None and cache_kind(k_flat).quantized:
            # A quantized cache: the chunk attends its own keys as stored, as every later token will
            # (and as a decode worker does after a handoff), so chunking does not change what is read.
            gather = self._slots(s.block_table, s.context_len, pm.block_size).to(self.device)
        if gather is not None:
            k = self._rows(k_flat, gather, q.dtype)
            v = self._rows(v_flat, gather, q.dtype)
        if pm.kv_mask is not None:   # a windowed chunk: each query its own window (cluster/kv/window.py)
            mask = torch.zeros(pm.kv_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~pm.kv_mask, float("-inf"))
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                               attn_mask=mask, scale=self.scale, enable_gqa=self.group > 1)
            return o[0].transpose(0, 1)
        if self._c_prefill(q, k, v):
            return cpu_ops.prefill_attention(q, k, v, window, self.scale)
        qh = q.transpose(0, 1)[None]        # [1, Hq, q, D]
        kh = k.transpose(0, 1)[None]        # [1, Hkv, ctx, D]
        vh = v.transpose(0, 1)[None]
        if s.context_len == s.query_len and (window is None or window >= s.query_len):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                               enable_gqa=self.group > 1)
        else:
            mask = pm.masks.get((window, q.dtype))
            if mask is None:
                qpos = torch.arange(s.context_len - s.query_len, s.context_len, device=q.device)[:, None]
                kpos = torch.arange(s.context_len, device=q.device)[None, :]
                allowed = _window_mask(qpos, kpos, torch.ones_like(kpos, dtype=torch.bool), window)
                mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
                pm.masks[(window, q.dtype)] = mask
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.group > 1)
        return o[0].transpose(0, 1)


def make_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                           device: torch.device, plan: KernelPlan | None = None,
                           dtype: torch.dtype | None = None, scale: float | None = None,
                           int4_view: bool = False) -> AttentionBackend:
    """Registry with lazy imports: optional backends load only when chosen. The torch backend
    follows `plan`'s decode-attention choice; both follow its batch-invariant mode. `dtype`, the
    KV cache's, sizes the Triton prefill tiles (smaller in fp32). `scale`: the softmax scale
    (None: head_dim ** -0.5; a model's is `ModelConfig.attention_scale`). `int4_view`: read an int8
    cache through its int4 view (the torch backend's only)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        if plan is not None and plan.batch_invariant and device.type != "cpu":
            raise ValueError("deterministic mode on a GPU runs the triton attention backend "
                             "(--attention-backend triton or auto), not torch")
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, device, plan, scale=scale, int4_view=int4_view)
    if name == "triton":
        if int4_view:
            raise ValueError("the int4 view of an int8 KV cache (--quantspec-kv-view int4) is read by the C kernels "
                             "and the torch attention backend, not triton")
        try:
            triton_backend = _triton_backend()
        except ImportError as exc:
            raise ValueError(
                "attention backend 'triton' is not available in this build "
                f"({exc}); use --attention-backend torch") from exc
        return triton_backend(num_heads, num_kv_heads, head_dim, device,
                              invariant=plan is not None and plan.batch_invariant, dtype=dtype, scale=scale)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")


def _triton_backend() -> type:
    """kernels/backend.py's `TritonAttentionBackend`; ImportError where Triton is not installed."""
    from kernels.backend import TritonAttentionBackend  # noqa: PLC0415 - Triton is optional (the kernels extra)
    return TritonAttentionBackend


def triton_mla_decode():
    """The Triton absorbed-MLA decode (kernels/mla_triton.py), through the Triton backend's lazy
    import; ImportError where Triton is not installed."""
    return _triton_backend().mla_decode


def _triton_available() -> bool:
    try:
        _triton_backend()
        return True
    except ImportError:
        return False
