"""EAGLE-style speculative-decoding head for ``stdlib-coder`` (plain torch).

Contract (what the serving engine must compute exactly)
-------------------------------------------------------
``f_j``: the target's hidden state at position ``j`` output by its LAST decoder
layer, BEFORE the final RMSNorm. ``f_{-1} = 0``. ``E``: the target's (frozen)
token embedding. For a sequence of (token, feature) pairs the head computes

    u_j = fc(cat([E(x_j), feat_j], -1))          # fc: Linear(2H -> H), no bias
    g   = LlamaDecoderLayer(u)                   # causal, RoPE at position id j
    logits_j = lm_head(norm(g_j))                # the target's own norm + lm_head

where ``feat_j = f_{j-1}`` for positions whose features come from the target.
``g_j`` estimates ``f_j`` and ``logits_j`` predicts ``x_{j+1}``. Drafting: with
true features up to ``f_{n-1}`` and the newest token ``x_n``, position ``n``
uses ``(x_n, f_{n-1})`` -> ``g_n``, ``d1 = argmax logits_n``; position ``n+i``
uses ``(d_i, g_{n+i-1})`` and attends to everything before it (the true
positions and the earlier drafted ones), and so on. ``EagleHead.forward`` is
the dense reference: run it on the whole sequence of pairs, drafted ones
included (``draft_greedy`` does exactly that).

The training-time test (``forward_unrolled``) is what the head trains with:
decode/spec/online/objective.py, beside the online trainer; the offline trainers
are bench/spec_training's.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

LAYER = "model.layers.0."
TENSOR_NAMES = ("fc.weight",) + tuple(LAYER + n for n in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"))


@dataclass
class EagleConfig:
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    vocab_size: int = 8192

    @classmethod
    def from_target(cls, target_dir: str, intermediate_size: int = 1024) -> "EagleConfig":
        with open(os.path.join(target_dir, "config.json")) as f:
            t = json.load(f)
        theta = t.get("rope_theta", (t.get("rope_parameters") or {}).get("rope_theta"))
        return cls(hidden_size=t["hidden_size"], intermediate_size=intermediate_size,
                   num_attention_heads=t["num_attention_heads"],
                   num_key_value_heads=t["num_key_value_heads"],
                   head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
                   rms_norm_eps=t["rms_norm_eps"], rope_theta=float(theta),
                   max_position_embeddings=t["max_position_embeddings"],
                   vocab_size=t["vocab_size"])

    def to_json(self, target_model: str = "stdlib-coder") -> dict:
        return {"architectures": ["SplitserveEagleHead"], "model_type": "splitserve_eagle",
                "target_model": target_model, **asdict(self), "torch_dtype": "bfloat16"}


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, scale by the weight in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """HF Llama default RoPE (rotate_half convention); positions: [T] int64."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()  # [T, head_dim]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.c = c
        H, nq, nkv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(H, nq * d, bias=False)
        self.k_proj = nn.Linear(H, nkv * d, bias=False)
        self.v_proj = nn.Linear(H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nq * d, H, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, nq, T, d]; k, v repeated to nq heads (q head i uses kv head i // rep)."""
        B, T, _ = x.shape
        c = self.c
        rep = c.num_attention_heads // c.num_key_value_heads
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def finish(self, u: torch.Tensor, attn_o: torch.Tensor) -> torch.Tensor:
        h = u + self.self_attn.out(attn_o)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Inner(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(c)])


@dataclass
class TargetParts:
    """The target's frozen tensors the head uses (tied: lm_head is embed)."""
    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    eps: float

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(g, self.norm, self.eps), self.lm_head)


def load_target_parts(target_dir: str, dtype=torch.float32) -> TargetParts:
    sd = load_file(os.path.join(target_dir, "model.safetensors"))
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    emb = sd["model.embed_tokens.weight"].to(dtype)
    head = sd["lm_head.weight"].to(dtype) if "lm_head.weight" in sd else emb
    return TargetParts(emb, sd["model.norm.weight"].to(dtype), head, cfg["rms_norm_eps"])


class EagleHead(nn.Module):
    def __init__(self, c: EagleConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.model = _Inner(c)
        # Training-only reparametrisation (folded away by save_eagle_head):
        # the target's features have rms ~42 and its embeddings rms ~0.07, so
        # training runs in a unit-rms space: embeddings times emb_mult, features
        # and outputs divided by feat_scale. 1.0 / 1.0 is the contract itself.
        self.emb_mult = 1.0
        self.feat_scale = 1.0

    @property
    def layer(self) -> DecoderLayer:
        return self.model.layers[0]

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Normal(0, std) matrices, ones for norms; fc's feature half = identity
        (so g starts as "the previous feature", the right scale), plus noise."""
        gen = torch.Generator().manual_seed(seed)
        H = self.config.hidden_size
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            self.fc.weight[:, H:] += torch.eye(H)

    def inputs(self, tokens: torch.Tensor, feats: torch.Tensor, tp: TargetParts) -> torch.Tensor:
        """u = fc(cat([E(tokens), feats])): tokens [B, T], feats [B, T, H]."""
        e = F.embedding(tokens, tp.embed) * self.emb_mult
        return self.fc(torch.cat([e.to(feats.dtype), feats], dim=-1)).to(feats.dtype)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, tp: TargetParts,
                start_pos: int = 0) -> torch.Tensor:
        """Dense reference: g [B, T, H] for the pairs (tokens[j], feats[j]) at
        positions start_pos + j, full causal attention among them."""
        u = self.inputs(tokens, feats, tp)
        T = u.shape[1]
        cos, sin = rope_cos_sin(torch.arange(start_pos, start_pos + T), self.config.head_dim,
                                self.config.rope_theta)
        lay = self.layer
        q, k, v = lay.self_attn.qkv(lay.input_layernorm(u), cos.to(u.dtype), sin.to(u.dtype))
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True)
        return lay.finish(u, o)


@torch.no_grad()
def draft_greedy(head: EagleHead, tp: TargetParts, tokens: list[int], f: torch.Tensor,
                 k: int) -> list[int]:
    """Draft k tokens after ``tokens`` (x_0..x_n) given true features ``f``
    ([n, H] or more rows: f_0..f_{n-1} are used). Dense reference: each draft
    step reruns the layer over the whole sequence of (token, feature) pairs."""
    n = len(tokens) - 1
    H = head.config.hidden_size
    dt = next(head.parameters()).dtype
    toks = torch.tensor(tokens)[None]
    feats = torch.cat([torch.zeros(1, 1, H, dtype=dt), f[None, :n].to(dt)], dim=1)  # [1, n+1, H]
    out = []
    for _ in range(k):
        g = head(toks, feats, tp)
        d = int(tp.logits(g[:, -1]).argmax(-1))
        out.append(d)
        toks = torch.cat([toks, torch.tensor([[d]])], dim=1)
        feats = torch.cat([feats, g[:, -1:]], dim=1)
    return out


def folded_state_dict(head: EagleHead) -> dict[str, torch.Tensor]:
    """fp32 weights of the contract function (emb_mult = feat_scale = 1).
    A head trained on (e * m, f / s) with outputs g / s computes, with fc's
    embedding half times s * m and o_proj, down_proj times s, exactly s times
    its outputs on (e, f) -- RMSNorm is scale-free up to eps (rms^2 ~1 vs 1e-5)."""
    H, s, m = head.config.hidden_size, head.feat_scale, head.emb_mult
    sd = {k: v.detach().float().clone() for k, v in head.state_dict().items()}
    sd["fc.weight"][:, :H] *= s * m
    for k in (LAYER + "self_attn.o_proj.weight", LAYER + "mlp.down_proj.weight"):
        sd[k] *= s
    return sd


def save_eagle_head(head: EagleHead, out_dir: str, target_model: str = "stdlib-coder") -> None:
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in folded_state_dict(head).items()}
    assert tuple(sorted(sd)) == tuple(sorted(TENSOR_NAMES)), sorted(sd)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head.config.to_json(target_model), f, indent=2)
        f.write("\n")


def load_eagle_head(d: str, dtype=torch.float32) -> EagleHead:
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    fields = EagleConfig.__dataclass_fields__
    head = EagleHead(EagleConfig(**{k: v for k, v in cfg.items() if k in fields}))
    head.load_state_dict({k: v.to(dtype) for k, v in load_file(os.path.join(d, "model.safetensors")).items()})
    return head.to(dtype).eval()


class FeatureHook:
    """Captures the pre-norm output of the target's last decoder layer (f).
    In transformers 5 ``hidden_states[-1]`` is AFTER model.norm, so hook instead."""

    def __init__(self, hf_model):
        self.f = None
        self.h = hf_model.model.layers[-1].register_forward_hook(self._hook)

    def _hook(self, mod, args, out):
        self.f = out[0] if isinstance(out, tuple) else out

    def remove(self) -> None:
        self.h.remove()
