"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Each token caches one vector per layer: the normalized compressed KV (kv_lora_rank wide) and the
RoPE'd key shared by every head (qk_rope_head_dim); no per-head K or V. The arena keeps the
layout of every other model ([layers, 2, blocks, block_size, 1, ceil(W / 2)]): the vector's first
half in the K plane, the rest in the V plane (`KVLayout.latent`), so transports, tiers and
checksums move latent blocks as they move K/V ones.

Decode rows (and each verification row, as a decode row of its own: the same arithmetic as plain
decoding at that position) attend in latent space with the up-projections absorbed: the query's
no-RoPE part times W_UK scores the latent directly, and the attention-weighted latent times W_UV
is the value. Prefill chunks go through the up-projection instead (K and V per head for the
chunk's context, one SDPA call), which is cheaper when many queries share the context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.model.attention import AttentionBatch, PrefillSpan
from kernels import mla_decode

LATENT_NORM_EPS = 1e-6   # transformers' q_a_layernorm / kv_a_layernorm keep RMSNorm's default eps


@dataclass
class MLAPrefill:
    span: PrefillSpan
    slots: torch.Tensor           # [context_len] flat slots of the span's context, its own tokens included
    mask: torch.Tensor | None     # additive [query_len, context_len]; None: plain causal


@dataclass
class MLAMeta:
    slot_mapping: torch.Tensor
    num_rows: int                 # rows attended in latent space: the decodes, then every verification token
    tables: torch.Tensor | None   # [num_rows, max_blocks] long
    lens: torch.Tensor | None     # [num_rows] keys each row attends (its position + 1)
    prefills: list[MLAPrefill]


def split_latent(latent: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, W] -> its K-plane and V-plane rows [T, half] (the V half zero-padded if W is odd)."""
    if latent.shape[1] < 2 * half:
        latent = F.pad(latent, (0, 2 * half - latent.shape[1]))
    return latent[:, :half], latent[:, half:]


class MLABackend:
    """Metadata for a step, latent stores and the two attention paths. `decode_kernel`: the
    absorbed decode (kernels/mla_decode.py: torch reference, C, Triton; same signature)."""

    name = "mla"
    table_dtype = torch.long
    verifies_trees = False    # a verification is a chain: each of its tokens a decode row

    def __init__(self, latent_dim: int, device: torch.device, decode_kernel=None):
        self.latent_dim = latent_dim
        self.half = -(-latent_dim // 2)
        self.device = device
        self.decode_kernel = decode_kernel or mla_decode.mla_decode_reference

    def static_decode_ready(self) -> bool:
        return False   # decode graphs replay the MHA backends' static metadata only

    def static_decode_meta(self, *args) -> None:
        raise ValueError("decode graphs (--cuda-graphs on) are not supported with latent attention (MLA, DeepSeek); "
                         "use --cuda-graphs auto or off")

    def prepare(self, batch: AttentionBatch) -> MLAMeta:
        if any(s.tree for s in batch.verifies):
            raise ValueError("token-tree verification is not supported with latent attention (MLA)")
        bs = batch.block_size
        tables: list[tuple[int, ...]] = list(batch.decode_block_tables[:batch.num_decode])
        lens: list[int] = list(batch.decode_context_lens[:batch.num_decode])
        for s in batch.verifies:   # each verification token as a decode row at its position
            first = s.context_len - s.query_len
            tables += [s.block_table] * s.query_len
            lens += [first + r + 1 for r in range(s.query_len)]
        table_t = lens_t = None
        if lens:
            width = -(-max(lens) // bs)
            rows = [list(t[:width]) + [0] * (width - len(t[:width])) for t in tables]
            table_t = torch.tensor(rows, dtype=torch.long, device=self.device)
            lens_t = torch.tensor(lens, dtype=torch.long, device=self.device)
        prefills = [self._prefill_meta(s, bs) for s in batch.prefills]
        return MLAMeta(batch.slot_mapping, len(lens), table_t, lens_t, prefills)

    def _prefill_meta(self, span: PrefillSpan, bs: int) -> MLAPrefill:
        blocks = torch.tensor(span.block_table, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:span.context_len].to(self.device)
        mask = None
        if span.context_len != span.query_len:
            qpos = torch.arange(span.context_len - span.query_len, span.context_len)[:, None]
            allowed = torch.arange(span.context_len)[None, :] <= qpos
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).to(self.device)
        return MLAPrefill(span, slots, mask)

    def store(self, latent: torch.Tensor, kv: torch.Tensor, meta: MLAMeta) -> None:
        """latent [T, W] at the step's slots of one layer's cache kv [2, blocks, bs, 1, half]."""
        k_rows, v_rows = split_latent(latent, self.half)
        kv[0].view(-1, self.half).index_copy_(0, meta.slot_mapping, k_rows)
        kv[1].view(-1, self.half).index_copy_(0, meta.slot_mapping, v_rows)

    def gather(self, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The latent vectors [n, W] at `slots`."""
        both = torch.cat((kv[0].view(-1, self.half).index_select(0, slots),
                          kv[1].view(-1, self.half).index_select(0, slots)), dim=-1)
        return both[:, :self.latent_dim]

    def decode(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, meta: MLAMeta,
               scale: float) -> torch.Tensor:
        """[R, H, C] latent-space outputs of the absorbed rows."""
        return self.decode_kernel(q_lat, q_pe, kv, meta.tables, meta.lens, scale)

    def prefill(self, q: torch.Tensor, kv: torch.Tensor, pm: MLAPrefill, up_proj, nope: int, v_dim: int,
                kv_lora_rank: int, scale: float) -> torch.Tensor:
        """q [n, H, nope + rope] of one chunk -> [n, H, v_dim]: its context's latent up-projected
        to per-head K and V, then causal SDPA."""
        latent = self.gather(kv, pm.slots)
        heads = q.shape[1]
        kv_up = up_proj(latent[:, :kv_lora_rank]).view(-1, heads, nope + v_dim)
        k_pe = latent[:, None, kv_lora_rank:].expand(-1, heads, -1)
        k = torch.cat((kv_up[..., :nope], k_pe), dim=-1)
        v = kv_up[..., nope:]
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if pm.mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=pm.mask.to(q.dtype), scale=scale)
        return o[0].transpose(0, 1)
