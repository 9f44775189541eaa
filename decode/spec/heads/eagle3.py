"""EAGLE-3-style draft head for the default model (SmolLM2-135M-Instruct), plain torch.

What EAGLE-3 changed over the EAGLE head of eagle.py, and what this one takes of it:
 - features fused from three depths of the target (low, middle, high: the outputs of decoder
   layers 1, L/2 - 1 and L - 4, as EAGLE-3 picks them) instead of the last layer's alone:
   f_j = fuse(cat(low_j, mid_j, high_j)), a learned 3H -> H projection;
 - no regression onto the target's features: the head is trained on tokens only, through the
   training-time test (several unrolled draft steps, each feeding the head its own output), so its
   hidden state is free to be whatever drafting needs;
 - its own norm and LM head over a draft vocabulary: the N tokens the target emits most often in
   the training answers (`d2t` maps them back to target ids). Here the target's full LM head is
   7x the rest of the head, so a draft step with it would cost a quarter of a target step.

The drafting contract is eagle.py's, with f_j the fused feature: position j reads
u_j = fc(cat(E(x_j), f_{j-1})) and one Llama layer gives g_j; logits_j = lm_head(norm(g_j)) over
the draft vocabulary; later draft positions read the head's own g in place of f. The decoder
layer and its attention are a plain Llama layer: the serving engine runs it over the target's
paged KV cache as one more layer (decode/spec/eagle_head.py), as for the EAGLE head.

Checkpoint format (`save_eagle3_head`): config.json with model_type "splitserve_eagle3",
feature_layers, draft_vocab_size and target_fingerprint (decode/spec/compat.py refuses a head
whose target's weights differ); tensors fuse.weight [H, 3H], fc.weight [H, 2H], the layer's,
norm.weight [H], lm_head.weight [N, H], d2t [N] (int64).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from decode.spec.heads.eagle import LAYER, EagleConfig, EagleHead, rms_norm

LAYER_TENSORS = tuple(LAYER + n for n in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"))
TENSOR_NAMES = ("fuse.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t") + LAYER_TENSORS


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The decoder layers whose outputs are fused (EAGLE-3's low, middle and high)."""
    return 1, num_layers // 2 - 1, num_layers - 4


@dataclass
class Eagle3Config(EagleConfig):
    draft_vocab_size: int = 8192
    feature_layers: tuple[int, int, int] = (1, 14, 26)

    def to_json(self, target_model: str = "SmolLM2-135M-Instruct", fingerprint: str = "") -> dict:
        return {"architectures": ["SplitserveEagle3Head"], "model_type": "splitserve_eagle3",
                "target_model": target_model, "target_fingerprint": fingerprint,
                **{k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()},
                "torch_dtype": "bfloat16"}


class Eagle3Head(EagleHead):
    def __init__(self, c: Eagle3Config, d2t: torch.Tensor):
        super().__init__(c)
        H = c.hidden_size
        self.fuse = nn.Linear(3 * H, H, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.long(), persistent=False)
        # Training-only: each depth's features divided by its rms, folded into fuse at export.
        self.register_buffer("depth_scale", torch.ones(3), persistent=False)

    def fused(self, feats3: torch.Tensor) -> torch.Tensor:
        """feats3 [..., 3H] (low, mid, high) -> f [..., H]."""
        H = self.config.hidden_size
        scaled = feats3 / self.depth_scale.repeat_interleave(H).to(feats3.dtype)
        return self.fuse(scaled)

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(g, self.norm_weight, self.config.rms_norm_eps))


def folded_state_dict(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """fp32 weights of the contract function: the training-time scales folded into fuse and fc."""
    H, m = head.config.hidden_size, head.emb_mult
    assert head.feat_scale == 1.0, "the EAGLE-3 head trains its features through fuse, unscaled"
    sd = {k: v.detach().float().clone() for k, v in head.state_dict().items()}
    sd["fuse.weight"] = sd["fuse.weight"] / head.depth_scale.repeat_interleave(H)[None, :].float()
    sd["fc.weight"][:, :H] *= m
    sd["norm.weight"] = sd.pop("norm_weight")
    sd["d2t"] = head.d2t.clone()
    return sd


def save_eagle3_head(head: Eagle3Head, out_dir: str, target_model: str, fingerprint: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: (v if k == "d2t" else v.to(torch.bfloat16)).contiguous() for k, v in folded_state_dict(head).items()}
    assert tuple(sorted(sd)) == tuple(sorted(TENSOR_NAMES)), sorted(sd)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head.config.to_json(target_model, fingerprint), f, indent=2)
        f.write("\n")


def load_eagle3_head(d: str, dtype=torch.float32) -> Eagle3Head:
    """The exported head as the plain-torch module (emb_mult = depth_scale = 1: the contract)."""
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    fields = Eagle3Config.__dataclass_fields__
    c = Eagle3Config(**{k: (tuple(v) if k == "feature_layers" else v) for k, v in cfg.items() if k in fields})
    sd = load_file(os.path.join(d, "model.safetensors"))
    head = Eagle3Head(c, sd.pop("d2t"))
    sd["norm_weight"] = sd.pop("norm.weight")
    head.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
    return head.to(dtype).eval()


@torch.no_grad()
def draft_greedy3(head: Eagle3Head, tp, tokens: list[int], feats3: torch.Tensor, k: int) -> list[int]:
    """Dense reference drafting: k target ids after `tokens` (x_0..x_n), given the target's three
    depths of features at positions 0..n-1 (feats3 [>= n, 3H])."""
    n = len(tokens) - 1
    dt = next(head.parameters()).dtype
    toks = torch.tensor(tokens)[None]
    f = head.fused(feats3[:n].to(dt))
    feats = torch.cat([f.new_zeros(1, f.shape[-1]), f])[None]       # f_{-1} = 0
    out = []
    for _ in range(k):
        g = head(toks, feats, tp)
        d = int(head.d2t[head.draft_logits(g[:, -1]).argmax(-1)])
        out.append(d)
        toks = torch.cat([toks, torch.tensor([[d]])], dim=1)
        feats = torch.cat([feats, g[:, -1:]], dim=1)
    return out
