"""The EAGLE head at serving time, over the paged KV cache.

Contract (the training side is bench/spec_training/eagle.py): for position j the head reads
u_j = fc(cat(E(x_j), f_{j-1})), where f is the target's last decoder layer output before the final
norm (f_{-1} = 0) and E the target's embedding; one Llama decoder layer turns u into g_j, the
head's estimate of f_j, and the target's own norm and lm_head turn g_j into next-token logits.

The head's KV is one more layer of the target's KV arena (same blocks, same slots). The engine
runs the head over every token the target computes, with the true features, so the head's KV
is right wherever the target's is: in prefix-cached blocks and in blocks handed off from a
prefill worker. Drafting then only adds positions past the verified ones.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from cluster.model.llama import CausalLM, DecoderLayer
from cluster.model.loader import LazyCheckpoint, TensorTaker, layer_state_dict
from cluster.model.model_config import ModelConfig
from cluster.model.spec_compat import read_eagle_config


class EagleHead(nn.Module):
    def __init__(self, layer_cfg: ModelConfig, target: CausalLM):
        super().__init__()
        h = layer_cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(layer_cfg, None)
        self.target = [target]   # not a submodule: its weights are the target's, not the head's

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, prev_features: torch.Tensor, positions: torch.Tensor,
                kv_layer: torch.Tensor, backend, meta, logits_indices: torch.Tensor | None = None):
        """Returns (g [T, H], fp32 logits of `logits_indices` rows or None); stores the head's KV."""
        target = self.target[0]
        u = self.fc.forward(torch.cat((target.embed(input_ids), prev_features), dim=-1))
        fp = target.new_pass(positions, u.dtype, backend, meta)
        g = self.layer.forward(u, fp, kv_layer[0], kv_layer[1])
        if logits_indices is None:
            return g, None
        return g, target.logits(g.index_select(0, logits_indices), fp)


def load_eagle_head(head_dir: Path, target_cfg: ModelConfig, target: CausalLM, dtype: torch.dtype,
                    device: torch.device) -> EagleHead:
    raw = read_eagle_config(head_dir)
    if target_cfg.attention_scale != target_cfg.head_dim ** -0.5:
        # The head attends through the target's backend, whose softmax scale is the target's.
        raise ValueError("an EAGLE head over a target with query_pre_attn_scalar (a softmax scale other "
                         "than head_dim ** -0.5) is not supported")
    # The head's layer is a plain Llama layer, whatever the target's family.
    layer_cfg = replace(target_cfg, architecture="LlamaForCausalLM", num_layers=1,
                        intermediate_size=int(raw["intermediate_size"]), qkv_bias=False, o_bias=False,
                        mlp_bias=False, layer_windows=(None,), hidden_act="silu", qk_norm=False, norm_offset=0.0,
                        sandwich_norm=False, local_rope=None, local_layers=())
    take = TensorTaker(LazyCheckpoint(Path(head_dir)))
    state = {"fc.weight": take("fc.weight"), **layer_state_dict(layer_cfg, take, "model.layers.0.", "layer.")}
    if take.missing:
        raise ValueError(f"EAGLE head {head_dir} is missing tensors: {', '.join(take.missing)}")
    head = EagleHead(layer_cfg, target)
    head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return head.to(device=device, dtype=dtype).eval()
