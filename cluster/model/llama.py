"""One decoder-only model for Llama, Qwen2 and Mistral checkpoints.

The forward pass works on a flat run of tokens (no padding) whose attention context lives in
the paged KV cache. Projections are fused (qkv, gate+up) so a layer is a handful of large ops:
at small batch the CPU is bound by per-op overhead and weight reads, not by arithmetic. How each
op runs (which kernel, per batch bucket) is the kernel plan's choice, made through `ForwardPass`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from cluster.model.attention import AttentionBackend
from cluster.model.kernel_plan import KernelPlan
from cluster.model.model_config import ModelConfig, RopeConfig
from cluster.model.ops import ForwardPass


class RMSNorm(nn.Module):
    """Holds the weight; the pass's kernel plan computes it (`ForwardPass.norm`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


class RotaryTable(nn.Module):
    """cos/sin for every position, computed once; a step gathers its rows."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        inv = rope_inv_freq(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        # Full-width tables, the sine signed for the rotated half: RoPE becomes 2 muls, 1 add, 1 cat.
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)    # [P, D] fp32
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, fp: ForwardPass, k_cache, v_cache, window):
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        if fp.fused_block:
            out = fp.backend.decode_block(qkv, fp.positions, fp.rotary, k_cache, v_cache, window, fp.meta)
            return self.o_proj.forward(out)
        qk = fp.rope(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        out = fp.backend.forward(q, k, v, k_cache, v_cache, window, fp.meta)
        return self.o_proj.forward(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # gate and up as one projection (one weight stream, one call); its output's halves feed
        # SiLU-times-up (a fused C op where the plan chooses it: torch's ops on the strided
        # halves are slow at prefill).
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, fp: ForwardPass) -> torch.Tensor:
        return self.down_proj.forward(fp.silu_mul(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None):
        super().__init__()
        self.window = window
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, fp: ForwardPass, k_cache, v_cache):
        """Updates x (the residual stream, [T, H]) in place and returns it. Submodules are called
        through .forward: nn.Module.__call__'s hook machinery costs more than a small op."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        attn = self.self_attn.forward(fp.norm(x, n1.weight, n1.eps), fp, k_cache, v_cache, self.window)
        x.add_(self.mlp.forward(fp.add_norm(attn, x, n2.weight, n2.eps), fp))
        return x


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in cfg.layer_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions)
        self.kernel_plan: KernelPlan | None = None   # set by cluster.model.kernels.apply_kernel_plan

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                backend: AttentionBackend, meta, logits_indices: torch.Tensor,
                layer_hook=None, return_hidden: bool = False):
        """input_ids, positions: [T]; kv_cache: [layers, 2, blocks, block_size, Hkv, D].
        Returns fp32 logits for the rows in `logits_indices` (and the pre-norm hidden states of
        every row with `return_hidden`). `layer_hook(i)` runs once layer i's
        KV is in the cache (layer-wise KV push overlaps the transfer with the rest of the pass)."""
        x = self.embed_tokens(input_ids)
        fp = self.new_pass(positions, x.dtype, backend, meta)
        for i, layer in enumerate(self.layers):
            layer.forward(x, fp, kv_cache[i, 0], kv_cache[i, 1])
            if layer_hook is not None:
                layer_hook(i)
        logits = self.lm_head.forward(self.final_norm(x.index_select(0, logits_indices), fp)).float()
        # The last layer's output before the norm: what an EAGLE head reads.
        return (logits, x) if return_hidden else logits

    def new_pass(self, positions: torch.Tensor, dtype: torch.dtype, backend, meta) -> ForwardPass:
        plan = self.kernel_plan or KernelPlan.reference(dtype, positions.device)
        return ForwardPass(plan, positions, self.rotary, dtype, backend, meta)

    def final_norm(self, x: torch.Tensor, fp: ForwardPass) -> torch.Tensor:
        return fp.norm(x, self.norm.weight, self.norm.eps)
