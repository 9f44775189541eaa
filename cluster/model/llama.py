"""One decoder-only model for Llama, Qwen2, Mistral, Qwen3, Gemma 3 and 4 (text) and Phi-3 checkpoints,
and the mixtures of experts among them (Qwen2-MoE, Qwen3-MoE, Mixtral: their sparse MLPs in moe.py).

The families differ by ModelConfig's feature fields, each a branch here: per-head q/k norms on
the fused qkv output before RoPE (Qwen3, Gemma 3); Gemma's sandwich norms, GeGLU, scaled
embeddings, per-layer-type RoPE tables and final-logit soft-capping; Gemma 4's value norms,
layer scalars, per-layer inputs (per_layer_inputs.py) and cross-layer KV sharing (a layer that
shares attends its source layer's cache with the K/V rows the source computed in the same pass,
and stores nothing: `ForwardPass.kv_rows`).
Gemma's (1 + w) norms are folded into the weights when they load (`loader.py`), and its softmax
scale is the attention backend's (`ModelConfig.attention_scale`).

The forward pass works on a flat run of tokens (no padding) whose attention context lives in
the paged KV cache. Projections are fused (qkv, gate+up) so a layer is a handful of large ops:
at small batch the CPU is bound by per-op overhead and weight reads, not by arithmetic. How each
op runs (which kernel, per batch bucket) is the kernel plan's choice, made through `ForwardPass`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from cluster.model import fused_layer
from cluster.model.attention import AttentionBackend
from cluster.model.kernel_plan import KernelPlan
from cluster.model.model_config import ModelConfig, RopeConfig
from cluster.model.moe import SparseMoeBlock
from cluster.model.ops import ForwardPass
from cluster.model.per_layer_inputs import LayerInputGate, PerLayerInputs


class RMSNorm(nn.Module):
    """Holds the weight; the pass's kernel plan computes it (`ForwardPass.norm`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    if rope.kind == "proportional":   # Gemma 4: the first dims rotate, the rest keep (frequency 0)
        angles = int(rope.partial * head_dim // 2)
        inv = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat((inv, torch.zeros(head_dim // 2 - angles))) / rope.factor
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


def _value_norm_(qkv: torch.Tensor, cfg: ModelConfig) -> None:
    """Gemma 4's scale-free RMSNorm over each value head of the fused projection, in place, in
    fp32 as transformers computes it."""
    v = qkv[:, cfg.q_size + cfg.kv_size:].view(qkv.shape[0], cfg.num_kv_heads, cfg.head_dim)
    vf = v.float()
    v.copy_(vf * torch.pow(vf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps, -0.5))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.index = index
        # A layer that shares another's K/V projects queries only (Gemma 4 stores no k/v weights for it).
        self.kv_source = cfg.kv_source_layer[index] if cfg.shares_kv(index) else None
        # Its K/V rows of a pass are kept for the layers that share them.
        self.feeds_shared = cfg.kv_source_layer.count(index) > 1
        kv_width = 0 if self.kv_source is not None else 2 * cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + kv_width, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            if self.kv_source is None:
                self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, fp: ForwardPass, k_cache, v_cache, window, local: bool = False):
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        if self.kv_source is not None:
            return self._shared(qkv, fp, k_cache, v_cache, window, local)
        if cfg.qk_norm:   # in place on the fused output: RoPE, and the fused decode block, read it after
            fp.head_norm(qkv, self.q_norm.weight, self.k_norm.weight, cfg.num_heads, cfg.num_kv_heads,
                         cfg.head_dim, self.q_norm.eps)
        if cfg.v_norm:
            _value_norm_(qkv, cfg)
        if fp.fused_block:
            if self.feeds_shared:   # a pure decode: the sharing layers read the cache alone
                fp.kv_rows[self.index] = (None, None)
            rotary = fp.local_rotary if local else fp.rotary
            out = fp.backend.decode_block(qkv, fp.positions, rotary, k_cache, v_cache, window, fp.meta)
            return self.o_proj.forward(out)
        qk = fp.rope(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, local)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.feeds_shared:
            fp.kv_rows[self.index] = (k, v)
        out = fp.backend.forward(q, k, v, k_cache, v_cache, window, fp.meta)
        return self.o_proj.forward(out)

    def _shared(self, q_proj: torch.Tensor, fp: ForwardPass, k_cache, v_cache, window, local: bool):
        """Attend the source layer's cache (k_cache, v_cache are its) with the K/V rows it computed
        in this pass; nothing is stored."""
        cfg = self.cfg
        if cfg.qk_norm:
            fp.head_norm(q_proj, self.q_norm.weight, None, cfg.num_heads, 0, cfg.head_dim, self.q_norm.eps)
        q = fp.rope(q_proj, cfg.num_heads, cfg.head_dim, local)
        k, v = fp.kv_rows[self.kv_source]
        out = fp.backend.forward(q, k, v, k_cache, v_cache, window, fp.meta, store=False)
        return self.o_proj.forward(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        # gate and up as one projection (one weight stream, one call); its output's halves feed
        # SiLU-times-up (a fused C op where the plan chooses it: torch's ops on the strided
        # halves are slow at prefill).
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.geglu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, fp: ForwardPass) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        return self.down_proj.forward(fp.gelu_mul(gate_up) if self.geglu else fp.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, local: bool = False, index: int = 0):
        super().__init__()
        self.window = window
        self.local = local   # RoPE from the local table (Gemma 3's sliding layers)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and cfg.moe.is_sparse(index)   # the experts replace the MLP (moe.py)
        self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size, index) if sparse else \
            MLP(cfg, cfg.layer_intermediate_size(index))
        self.sandwich = cfg.sandwich_norm
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.per_layer_input = LayerInputGate(index, cfg.hidden_size, cfg.per_layer_input_size, cfg.rms_norm_eps) \
            if cfg.per_layer_input_size else None
        if cfg.layer_scalar:   # Gemma 4: the layer's output (the whole residual stream) times a learned scalar
            self.layer_scalar = nn.Parameter(torch.empty(1))

    def forward(self, x, fp: ForwardPass, k_cache, v_cache):
        """Updates x (the residual stream, [T, H]) in place and returns it. Submodules are called
        through .forward: nn.Module.__call__'s hook machinery costs more than a small op."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        attn = self.self_attn.forward(fp.norm(x, n1.weight, n1.eps), fp, k_cache, v_cache, self.window, self.local)
        if not self.sandwich:
            x.add_(self.mlp.forward(fp.add_norm(attn, x, n2.weight, n2.eps), fp))
            return x
        # Gemma 3: x += post_attention_norm(attn); x += post_feedforward_norm(mlp(pre_feedforward_norm(x))).
        n3, n4 = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        h = fp.add_norm(fp.norm(attn, n2.weight, n2.eps), x, n3.weight, n3.eps)
        x.add_(fp.norm(self.mlp.forward(h, fp), n4.weight, n4.eps))
        if self.per_layer_input is not None:
            self.per_layer_input.forward(x, fp)
        if hasattr(self, "layer_scalar"):
            x.mul_(self.layer_scalar)
        return x


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        # An empty weight (the checkpoint's is assigned over it): Embedding's own random init
        # would run torch's Python reference of normal_ on the meta device, which imports
        # torch._dynamo, 1.5-2 s of every worker's start.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, w, cfg.layer_is_local(i), i)
                                    for i, w in enumerate(cfg.layer_windows))
        self.kv_layers = cfg.kv_arena_layers()   # each layer's K/V in the arena (its source's, where it shares)
        self.per_layer_inputs = PerLayerInputs(cfg.num_layers, cfg.per_layer_input_size, cfg.per_layer_vocab_size,
                                               cfg.hidden_size, cfg.rms_norm_eps) if cfg.per_layer_input_size else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._fused_layers: list | None = None
        self.build_rotary(max_positions)
        self.kernel_plan: KernelPlan | None = None   # set by cluster.model.kernels.apply_kernel_plan
        self._embed_scales: dict[torch.dtype, float] = {}

    def build_rotary(self, max_positions: int, device: torch.device | str | None = None) -> None:
        """The RoPE tables (computed, never loaded): the global one and, where the config has
        one, the local layers'."""
        cfg = self.cfg

        def table(rope: RopeConfig) -> RotaryTable:
            # Computed on the CPU, then moved: on the meta device (the loader builds the model
            # there) torch's Python references would run, importing torch._dynamo (1-2 s a worker).
            with torch.device("cpu"):
                t = RotaryTable(rope, cfg.head_dim, max_positions)
            return t if device is None else t.to(device)
        self._fused_layers = None   # they point at the tables
        self.rotary = table(cfg.rope)
        self.local_rotary = None if cfg.local_rope is None else table(cfg.local_rope)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                backend: AttentionBackend, meta, logits_indices: torch.Tensor,
                return_hidden: bool = False, hidden_layers: tuple[int, ...] = ()):
        """input_ids, positions: [T]; kv_cache: [KV layers, 2, blocks, block_size, Hkv, D].
        Returns fp32 logits for the rows in `logits_indices` (and, with `return_hidden`, the hidden
        states of every row: the last layer's output before the norm, or the outputs of
        `hidden_layers` side by side, [T, len * H])."""
        x = self.embed(input_ids)
        fp = self.new_pass(positions, x.dtype, backend, meta)
        if self.per_layer_inputs is not None:
            fp.layer_inputs = self.per_layer_inputs.forward(input_ids, x, fp)
        fused = fused_layer.prepare(self, x, fp, kv_cache) if fp.fused_block else None
        last = len(self.layers) - 1
        kept = []
        for i, layer in enumerate(self.layers):
            if fused is None or not fused.run(i):
                kv = self.kv_layers[i]
                layer.forward(x, fp, kv_cache[kv, 0], kv_cache[kv, 1])
            if i in hidden_layers:   # the layers update x in place: keep a copy (the last needs none)
                kept.append(x if i == last else x.clone())
        logits = self.logits(x.index_select(0, logits_indices), fp)
        if not return_hidden:
            return logits
        # An EAGLE head reads the last layer's output; an EAGLE-3 head three depths of it.
        return logits, (torch.cat(kept, dim=-1) if hidden_layers else x)

    def fused_layer_args(self) -> list:
        """Each layer's weights for one C call per layer (fused_layer.py), built at the first pure
        decode pass; None for a layer that does not qualify. Whoever swaps a layer's modules or
        flags after that calls invalidate_fused_layers()."""
        if self._fused_layers is None:
            self._fused_layers = [fused_layer.layer_args(layer, self.rotary, self.local_rotary or self.rotary)
                                  for layer in self.layers]
        return self._fused_layers

    def invalidate_fused_layers(self) -> None:
        self._fused_layers = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, H] (a new tensor), scaled where the family scales them."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale is not None:
            scale = self._embed_scales.get(x.dtype)
            if scale is None:   # transformers rounds the scale to the model's dtype first
                scale = self._embed_scales[x.dtype] = float(torch.tensor(self.cfg.embed_scale, dtype=x.dtype))
            x.mul_(scale)
        return x

    def logits(self, x: torch.Tensor, fp: ForwardPass) -> torch.Tensor:
        """fp32 logits of the rows of x (hidden states before the final norm), soft-capped in the
        model's dtype where the config caps them."""
        logits = self.lm_head.forward(self.final_norm(x, fp))
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def new_pass(self, positions: torch.Tensor, dtype: torch.dtype, backend, meta) -> ForwardPass:
        plan = self.kernel_plan or KernelPlan.reference(dtype, positions.device)
        return ForwardPass(plan, positions, self.rotary, dtype, backend, meta, self.local_rotary)

    def final_norm(self, x: torch.Tensor, fp: ForwardPass) -> torch.Tensor:
        return fp.norm(x, self.norm.weight, self.norm.eps)
