"""A DFlash-style block drafter (plain torch): one forward pass proposes a block of k tokens.

Contract (what serving computes: decode/spec/block.py runs this module itself)
-------------------------------------------------------------------------------
With the verified tokens x_0..x_n (x_n the pending one, not yet fed to the target) and the
target's features f_j (three depths side by side, [3H], as EAGLE-3's: `feature_layers`) of the
last c <= `context` positions n-c..n-1, the drafter builds

    ctx_j = fuse(f_j)                                 # [C, H] context rows, positions n-c..n-1
    u     = [E(x_n) * emb_scale, m, m, ..., m]        # [K, H]: the pending token, then K-1 mask rows
    u     = DecoderLayer(u | keys/values = norm(ctx) ++ norm(u))   # each layer, RoPE at true positions

where every block row attends to every context row and to every block row (bidirectional inside
the block: the rows are drafted together, not one by one). The target's own final norm and the
rows of its LM head for a draft vocabulary (`d2t`: the most frequent answer tokens; no weights of
the drafter's own) turn row i into logits for x_{n+1+i}: a block's logits cost 1/6 of the full
vocabulary's, which at 8 rows would cost as much as a target step of this model. Context rows are keys and values only; they are not updated
by the layers, so a layer's cost is K query rows over C + K keys.

Nothing here touches the paged KV cache: the drafter's state is the window of context rows, which
a prefill worker computes and ships with a handoff (KVHandle's speculative state) and a prefix hit
never needs (a hit leaves at least the prompt's last token to compute, which gives one row).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from safetensors.torch import load_file, save_file
import torch
import torch.nn as nn
import torch.nn.functional as F

from decode.spec.heads.eagle import DecoderLayer, EagleConfig, TargetParts, rms_norm, rope_cos_sin

MODEL_TYPE = "splitserve_block"


@dataclass
class BlockConfig(EagleConfig):
    block_size: int = 8                     # K: rows drafted by one pass (the widest draft)
    context: int = 16                       # C: target feature rows the drafter reads
    num_layers: int = 1
    feature_layers: tuple[int, int, int] = (1, 14, 26)
    emb_scale: float = 1.0                  # the pending token's embedding scale (to the mask row's rms)
    draft_vocab_size: int = 8192            # target ids the drafter proposes (d2t: draft id -> target id)

    def to_json(self, target_model: str = "SmolLM2-135M-Instruct", fingerprint: str = "") -> dict:
        return {"architectures": ["SplitserveBlockDrafter"], "model_type": MODEL_TYPE,
                "target_model": target_model, "target_fingerprint": fingerprint,
                **{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()},
                "torch_dtype": "bfloat16"}

    @classmethod
    def from_json(cls, raw: dict) -> "BlockConfig":
        fields = cls.__dataclass_fields__
        return cls(**{k: (tuple(v) if k == "feature_layers" else v) for k, v in raw.items() if k in fields})


class BlockDrafter(nn.Module):
    def __init__(self, c: BlockConfig, d2t: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long) if d2t is None else d2t.long())
        self.fuse = nn.Linear(3 * H, H, bias=False)
        self.mask_embed = nn.Parameter(torch.zeros(H))
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.num_layers)])
        # Training-only: each depth divided by its rms, folded into fuse by `folded_state_dict`.
        self.register_buffer("depth_scale", torch.ones(3), persistent=False)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "mask_embed":
                    p.copy_(torch.randn(p.shape, generator=gen))
                elif p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def fused(self, feats3: torch.Tensor) -> torch.Tensor:
        """feats3 [..., 3H] (low, mid, high) -> context rows [..., H]."""
        H = self.config.hidden_size
        return self.fuse(feats3 / self.depth_scale.repeat_interleave(H).to(feats3.dtype))

    def forward(self, embed, first: torch.Tensor, ctx: torch.Tensor, ctx_len: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        """g [B, K, H]; row i estimates the feature that predicts x_{n+1+i}.

        embed: token ids -> the target's embeddings; first [B]: x_n; ctx [B, C, H] fused context
        rows, right-aligned (row C-1 is position n-1), of which the last ctx_len [B] are valid;
        pos [B]: n."""
        c = self.config
        B, C, H = ctx.shape
        K = c.block_size
        u = torch.cat([(embed(first) * c.emb_scale).to(ctx.dtype)[:, None],
                       self.mask_embed.to(ctx.dtype).expand(B, K - 1, H)], dim=1)
        offsets = torch.arange(-C, K, device=ctx.device)
        positions = (pos[:, None] + offsets[None]).clamp(min=0)          # [B, C + K]
        cos, sin = rope_cos_sin(positions.flatten().cpu(), c.head_dim, c.rope_theta)
        cos = cos.view(B, 1, C + K, -1).to(device=ctx.device, dtype=ctx.dtype)
        sin = sin.view(B, 1, C + K, -1).to(device=ctx.device, dtype=ctx.dtype)
        valid = torch.arange(C, device=ctx.device)[None] >= (C - ctx_len)[:, None]   # [B, C]
        visible = torch.cat([valid, valid.new_ones(B, K)], dim=1)[:, None, None]     # [B, 1, 1, C + K]
        for layer in self.layers:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(torch.cat([ctx, u], dim=1)), cos, sin)
            o = F.scaled_dot_product_attention(q[:, :, C:], k, v, attn_mask=visible)
            u = layer.finish(u, o)
        return u


def draft_logits(g: torch.Tensor, tp: TargetParts, head_rows: torch.Tensor) -> torch.Tensor:
    """Logits over the draft vocabulary: the target's final norm, its LM-head rows for d2t."""
    return F.linear(rms_norm(g, tp.norm, tp.eps), head_rows)


def folded_state_dict(drafter: BlockDrafter) -> dict[str, torch.Tensor]:
    """fp32 weights of the contract: the training-time depth scales folded into fuse."""
    H = drafter.config.hidden_size
    sd = {k: v.detach().clone() if k == "d2t" else v.detach().float().clone() for k, v in drafter.state_dict().items()}
    sd["fuse.weight"] = sd["fuse.weight"] / drafter.depth_scale.repeat_interleave(H)[None, :].float()
    return sd


def save_block_drafter(drafter: BlockDrafter, out_dir: str, target_model: str, fingerprint: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: (v if k == "d2t" else v.to(torch.bfloat16)).contiguous() for k, v in folded_state_dict(drafter).items()}
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(drafter.config.to_json(target_model, fingerprint), f, indent=2)
        f.write("\n")


def load_block_drafter(d: str, dtype=torch.float32) -> BlockDrafter:
    """The exported drafter (depth_scale 1: the contract); its tensors checked by name and shape."""
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{d} is not a block drafter (model_type {raw.get('model_type')!r}, expected {MODEL_TYPE!r})")
    sd = load_file(os.path.join(d, "model.safetensors"))
    drafter = BlockDrafter(BlockConfig.from_json(raw), sd.pop("d2t"))
    drafter.load_state_dict({**{k: v.to(dtype) for k, v in sd.items()}, "d2t": drafter.d2t})
    return drafter.to(dtype).eval()   # d2t stays int64 (.to(dtype) leaves integer buffers alone)


@torch.no_grad()
def draft_block_reference(drafter: BlockDrafter, tp: TargetParts, tokens: list[int], feats3: torch.Tensor,
                          k: int) -> list[int]:
    """Dense reference: the k tokens drafted after `tokens` (x_0..x_n) from the target's features
    at positions 0..n-1 (feats3 [>= n, 3H]), the last `context` of them."""
    n = len(tokens) - 1
    C = drafter.config.context
    dt = next(drafter.parameters()).dtype
    rows = drafter.fused(feats3[max(0, n - C):n].to(dt))
    ctx = torch.cat([rows.new_zeros(C - len(rows), rows.shape[-1]), rows])[None]
    g = drafter(lambda ids: F.embedding(ids, tp.embed.to(dt)), torch.tensor([tokens[-1]]), ctx,
                torch.tensor([len(rows)]), torch.tensor([n]))
    logits = draft_logits(g[0, :k], tp, tp.lm_head[drafter.d2t].to(dt))
    return drafter.d2t[logits.argmax(-1)].tolist()
