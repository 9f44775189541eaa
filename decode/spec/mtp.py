"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative head (`--speculative mtp`).

The checkpoint keeps it after the last decoder layer (`model.layers.{L}.*`, L = num_hidden_layers):
for position j it reads u_j = eh_proj(cat(enorm(E(x_j)), hnorm(f_{j-1}))), with f the target's
final-normed hidden state (as vLLM and SGLang feed it) and E the target's embedding; one decoder
layer (latent attention, its own KV: one more latent layer of the arena) turns u into g_j, and
shared_head.norm and shared_head.head give the next token's logits. That is the EAGLE head's
contract (eagle_head.py), so the EAGLE features pass, proposer and verification serve it as they
are: f crosses the P/D handoff as the EAGLE feature does.

transformers neither builds nor saves the MTP layer: a checkpoint saved by it names
num_nextn_predict_layers without the weights, and serves without them; `--speculative mtp` on it
is refused by name (`check_mtp`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cluster.model.deepseek import DeepseekForCausalLM, DeepseekLayer
from cluster.model.deepseek_weights import deepseek_layer_state_dict
from cluster.model.llama import RMSNorm
from cluster.model.loader import LazyCheckpoint, TensorTaker
from cluster.model.model_config import ModelConfig

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")


def mtp_prefix(cfg: ModelConfig) -> str:
    return f"model.layers.{cfg.num_layers}."


def check_mtp(cfg: ModelConfig, model_dir: Path) -> None:
    """A ValueError naming why `--speculative mtp` cannot serve this checkpoint."""
    if cfg.mla is None or cfg.mla.version != 3:
        raise ValueError(f"--speculative mtp needs a DeepSeek-V3 checkpoint with MTP layers; {cfg.architecture} "
                         "has none (use --speculative ngram, draft or eagle)")
    if cfg.mla.num_mtp_layers < 1:
        raise ValueError("--speculative mtp: the checkpoint's config names no MTP layer (num_nextn_predict_layers 0)")
    names = LazyCheckpoint(model_dir)   # opens the shards' indexes; reads no tensor
    missing = [n for n in _OWN if mtp_prefix(cfg) + n not in names]
    if missing:
        raise ValueError(f"--speculative mtp: the checkpoint names {cfg.mla.num_mtp_layers} MTP layer(s) "
                         f"(num_nextn_predict_layers) but lacks their weights ({mtp_prefix(cfg)}{missing[0]}, ...; "
                         "transformers saves none): it serves without them; use --speculative ngram")


class MTPHead(nn.Module):
    """The EAGLE head's interface (features, forward, lm_head None) over the MTP layer."""

    lm_head = None   # logits come from shared_head; nothing here is trained online

    def __init__(self, cfg: ModelConfig, target: DeepseekForCausalLM):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekLayer(cfg, cfg.num_layers)
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.target = [target]   # not a submodule: the embedding and RoPE are the target's

    @torch.inference_mode()
    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """f: the target's last layer output, final-normed."""
        target = self.target[0]
        rows = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
        return target.final_norm(hidden, target.new_pass(rows, hidden.dtype, None, None))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, prev_features: torch.Tensor, positions: torch.Tensor,
                kv_layer: torch.Tensor, backend, meta, logits_indices: torch.Tensor | None = None):
        target = self.target[0]
        fp = target.new_pass(positions, prev_features.dtype, backend, meta)
        e, h = self.enorm, self.hnorm
        u = self.eh_proj.forward(torch.cat((fp.norm(target.embed(input_ids), e.weight, e.eps),
                                            fp.norm(prev_features, h.weight, h.eps)), dim=-1))
        g = self.layer.forward(u, fp, kv_layer, target.rotary, target.rotary.lookup(positions, u.dtype))
        if logits_indices is None:
            return g, None
        rows = g.index_select(0, logits_indices)
        n = self.head_norm
        return g, self.head.forward(fp.norm(rows, n.weight, n.eps)).float()


def load_mtp_head(model_dir: Path, cfg: ModelConfig, target: DeepseekForCausalLM, dtype: torch.dtype,
                  device: torch.device) -> MTPHead:
    check_mtp(cfg, model_dir)
    take = TensorTaker(LazyCheckpoint(model_dir, device))
    prefix = mtp_prefix(cfg)
    state = {"enorm.weight": take(prefix + "enorm.weight"), "hnorm.weight": take(prefix + "hnorm.weight"),
             "eh_proj.weight": take(prefix + "eh_proj.weight"),
             "head_norm.weight": take(prefix + "shared_head.norm.weight"),
             "head.weight": take(prefix + "shared_head.head.weight"),
             **deepseek_layer_state_dict(cfg, take, prefix, "layer.", cfg.num_layers)}
    if take.missing:
        raise ValueError(f"--speculative mtp: the MTP layer lacks tensors: {', '.join(take.missing[:5])}")
    with torch.device("meta"):
        head = MTPHead(cfg, target)
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    return head.eval()
