"""What the EAGLE heads train with, online here (trainer.py) and offline in bench/spec_training.

`forward_unrolled` is the training-time test: pass ``s`` computes, for every position ``j`` at
once, what the head (decode/spec/heads/eagle.py's `EagleHead` or eagle3.py's `Eagle3Head`)
outputs at draft step ``s + 1`` when the true prefix ends at ``j - s`` (teacher-forced tokens);
it equals the dense reference on the corresponding sequence (checked by the unit test).
`target_to_draft` maps the target's tokens to an EAGLE-3 head's draft ids, the labels it learns.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from decode.spec.heads.eagle import EagleHead, TargetParts, rope_cos_sin


def forward_unrolled(head: EagleHead, tokens: torch.Tensor, f: torch.Tensor, tp: TargetParts,
                     passes: int, detach: bool = False) -> list[torch.Tensor]:
    """Training-time test. tokens [B, T], f [B, T, H] (f_j for the same tokens).
    Returns [g_0, ..., g_{passes-1}], each [B, T, H]; g_s[:, j] is the head's
    output at draft step s + 1 whose true prefix ends at position j - s (rows
    j < s are meaningless). Pass s's query at j sees pass-0 keys at 0..j-s and
    the pass-t key at j-s+t for t = 1..s (the drafted positions before it)."""
    c = head.config
    B, T, _ = f.shape
    cos, sin = rope_cos_sin(torch.arange(T), c.head_dim, c.rope_theta)
    lay = head.layer
    scale = 1.0 / math.sqrt(c.head_dim)
    idx = torch.arange(T)
    outs, ks, vs = [], [], []
    prev = f
    for s in range(passes):
        feat = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        u = head.inputs(tokens, feat, tp)
        q, k, v = lay.self_attn.qkv(lay.input_layernorm(u), cos.to(u.dtype), sin.to(u.dtype))
        if s == 0:
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True)
        else:
            k0, v0 = ks[0], vs[0]
            sc = torch.matmul(q, k0.transpose(-1, -2)).float() * scale
            sc = sc.masked_fill(idx[None, :] > (idx[:, None] - s), float("-inf"))
            extra, vals = [], []
            for t in range(1, s + 1):
                kt, vt = (k, v) if t == s else (ks[t], vs[t])
                sh = s - t  # key of pass t sits sh positions before the query
                if sh:
                    kt = torch.cat([kt.new_zeros(B, kt.shape[1], sh, c.head_dim), kt[:, :, :-sh]], 2)
                    vt = torch.cat([vt.new_zeros(B, vt.shape[1], sh, c.head_dim), vt[:, :, :-sh]], 2)
                e = (q.float() * kt.float()).sum(-1) * scale
                extra.append(e.masked_fill(idx < sh, float("-inf")))
                vals.append(vt)
            p = torch.softmax(torch.cat([sc, torch.stack(extra, -1)], -1), dim=-1)
            o = torch.matmul(p[..., :T].to(v0.dtype), v0).float()
            for t, vt in enumerate(vals):
                o = o + p[..., T + t, None] * vt.float()
            o = o.to(q.dtype)
        ks.append(k)
        vs.append(v)
        g = lay.finish(u, o)
        outs.append(g)
        prev = g.detach() if detach else g
    return outs


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """target id -> draft id, -100 (ignored by cross_entropy) where the draft vocab lacks it."""
    t2d = torch.full((vocab_size,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    return t2d
