"""DeepSeek-V2 / V3 decoder: multi-head latent attention (mla.py) over the latent cache, dense MLP
layers up to `first_k_dense_replace`, then mixture-of-experts layers (deepseek_moe.py).

Same interface as `CausalLM` (the runner, sampler and speculators see no difference): it subclasses
it for the embedding, the logits and the pass set-up, and builds its own layers and RoPE.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from cluster.model.deepseek_moe import DeepseekMoE
from cluster.model.llama import MLP, CausalLM, RMSNorm
from cluster.model.mla import LATENT_NORM_EPS, MLABackend, MLAMeta
from cluster.model.mla_config import MLAConfig, YarnRope
from cluster.model.model_config import ModelConfig
from cluster.model.ops import ForwardPass


def yarn_inv_freq(yarn: YarnRope, dim: int, base: float) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters` inverse frequencies."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class LatentRotary(nn.Module):
    """cos/sin of the RoPE dims for every position ([P, rope / 2]), scaled as yarn scales them."""

    def __init__(self, mla: MLAConfig, max_positions: int):
        super().__init__()
        dim = mla.qk_rope_head_dim
        if mla.yarn is None:
            inv, factor = 1.0 / (mla.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
        else:
            inv, factor = yarn_inv_freq(mla.yarn, dim, mla.rope_theta), mla.yarn.cos_sin_factor()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)
        self.interleave = mla.rope_interleave

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, rope]. Interleaved pairs come out de-interleaved (evens' rotations, then odds'),
        as transformers' V3 writes them: queries and keys alike, so their products do not change."""
        half = x.shape[-1] // 2
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if self.interleave else (x[..., :half], x[..., half:])
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        mla = cfg.mla
        self.mla = mla
        h, heads = cfg.hidden_size, cfg.num_heads
        self.num_heads = heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=mla.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.latent_dim, bias=mla.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=mla.attention_bias)
        # kv_b_proj's two halves per head, kept dense beside it for the absorbed decode (set at load).
        self.w_uk = nn.Parameter(torch.empty(heads, mla.qk_nope_head_dim, mla.kv_lora_rank), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(heads, mla.v_head_dim, mla.kv_lora_rank), requires_grad=False)

    def queries(self, x: torch.Tensor, fp: ForwardPass) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            q = self.q_proj.forward(x)
        else:
            n = self.q_a_layernorm
            q = self.q_b_proj.forward(fp.norm(self.q_a_proj.forward(x), n.weight, n.eps))
        return q.view(x.shape[0], self.num_heads, self.mla.qk_head_dim)

    def forward(self, x, fp: ForwardPass, kv: torch.Tensor, rotary: LatentRotary, cos_sin) -> torch.Tensor:
        mla, t = self.mla, x.shape[0]
        nope, c_dim = mla.qk_nope_head_dim, mla.kv_lora_rank
        q = self.queries(x, fp)
        ckv = self.kv_a_proj_with_mqa.forward(x)
        n = self.kv_a_layernorm
        c = fp.norm(ckv[:, :c_dim].contiguous(), n.weight, n.eps)
        q_pe = rotary.apply(q[..., nope:], *cos_sin)
        k_pe = rotary.apply(ckv[:, None, c_dim:], *cos_sin)[:, 0]
        backend: MLABackend = fp.backend
        meta: MLAMeta = fp.meta
        backend.store(torch.cat((c, k_pe), dim=-1), kv, meta)
        out = torch.empty((t, self.num_heads, mla.v_head_dim), dtype=x.dtype, device=x.device)
        rows = meta.num_rows
        scale = mla.softmax_scale
        if rows:
            q_lat = torch.einsum("thn,hnc->thc", q[:rows, :, :nope], self.w_uk)
            o_lat = backend.decode(q_lat, q_pe[:rows].contiguous(), kv, meta, scale)
            out[:rows] = torch.einsum("thc,hvc->thv", o_lat, self.w_uv)
        if meta.prefills:
            q_full = torch.cat((q[..., :nope], q_pe), dim=-1)
            for pm in meta.prefills:
                sl = slice(pm.span.query_start, pm.span.query_start + pm.span.query_len)
                out[sl] = backend.prefill(q_full[sl], kv, pm, self.kv_b_proj.forward, nope, mla.v_head_dim,
                                          c_dim, scale)
        return self.o_proj.forward(out.view(t, -1))


class DeepseekLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMoE(cfg, index) if cfg.mla.layer_is_moe(index) else MLP(cfg)

    def forward(self, x, fp: ForwardPass, kv, rotary, cos_sin):
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        attn = self.self_attn.forward(fp.norm(x, n1.weight, n1.eps), fp, kv, rotary, cos_sin)
        x.add_(self.mlp.forward(fp.add_norm(attn, x, n2.weight, n2.eps), fp))
        return x


class DeepseekForCausalLM(CausalLM):
    """`CausalLM`'s interface over DeepSeek layers. kv_cache: the latent arena
    [layers, 2, blocks, block_size, 1, half] (`KVLayout.latent`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DeepseekLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._fused_layers = None
        self.local_rotary = None
        self.build_rotary(max_positions)
        self.kernel_plan = None
        self._embed_scales = {}

    def build_rotary(self, max_positions: int, device: torch.device | str | None = None) -> None:
        with torch.device("cpu"):
            table = LatentRotary(self.cfg.mla, max_positions)
        self.rotary = table if device is None else table.to(device)

    def fused_layer_args(self) -> list:
        return [None] * len(self.layers)   # no fused C decode layer for latent attention

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                backend, meta, logits_indices: torch.Tensor, return_hidden: bool = False,
                hidden_layers: tuple[int, ...] = ()):
        x = self.embed(input_ids)
        fp = self.new_pass(positions, x.dtype, backend, meta)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        last = len(self.layers) - 1
        kept = []
        for i, layer in enumerate(self.layers):
            layer.forward(x, fp, kv_cache[i], self.rotary, cos_sin)
            if i in hidden_layers:
                kept.append(x if i == last else x.clone())
        logits = self.logits(x.index_select(0, logits_indices), fp)
        if not return_hidden:
            return logits
        return logits, (torch.cat(kept, dim=-1) if hidden_layers else x)
