"""DeepSeek's mixture-of-experts layer: its own routing, shared experts, and the routed experts'
compute through `MoEExperts` (cluster/model/moe.py, the one expert implementation).

Routing, as transformers computes it (router logits in float32 from a float32 gate):
 - V3 (`noaux_tc`): sigmoid scores; the choice adds `e_score_correction_bias`; with n_group, each
   group scores by its two best choices and only the best `topk_group` groups stay; the top k by
   choice, weighted by their (uncorrected) scores, renormalized where norm_topk_prob, times
   routed_scaling_factor;
 - V2: softmax scores; `greedy` takes the top k, `group_limited_greedy` first keeps the best
   `topk_group` groups by their best score; weights times routed_scaling_factor.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.llama import MLP
from cluster.model.mla_config import MoERouting
from cluster.model.model_config import ModelConfig
from cluster.model.moe import MoEExperts


def _keep_groups(choice: torch.Tensor, group_scores: torch.Tensor, routing: MoERouting, fill: float) -> torch.Tensor:
    """`choice` [T, E] with every expert outside the best `topk_group` groups set to `fill`."""
    groups = routing.n_group
    best = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
    keep = keep[:, :, None].expand(-1, groups, routing.num_experts // groups).reshape(-1, routing.num_experts)
    return choice.masked_fill(~keep, fill)


def v3_topk(logits: torch.Tensor, bias: torch.Tensor, routing: MoERouting) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.sigmoid()
    choice = scores + bias
    if routing.n_group and routing.n_group > 1:
        grouped = choice.view(-1, routing.n_group, routing.num_experts // routing.n_group)
        choice = _keep_groups(choice, grouped.topk(2, dim=-1)[0].sum(dim=-1), routing, float("-inf"))
    ids = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if routing.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * routing.routed_scaling_factor


def v2_topk(logits: torch.Tensor, routing: MoERouting) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if routing.topk_method == "group_limited_greedy":
        grouped = scores.view(-1, routing.n_group, routing.num_experts // routing.n_group)
        scores = _keep_groups(scores, grouped.max(dim=-1).values, routing, 0.0)
    weights, ids = torch.topk(scores, k=routing.top_k, dim=-1, sorted=False)
    return ids, weights * routing.routed_scaling_factor


class DeepseekRouter(nn.Module):
    """The gate: weight [E, H] (and V3's correction bias [E]), applied in float32."""

    def __init__(self, routing: MoERouting, hidden_size: int):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size))
        self.sigmoid = routing.scoring == "sigmoid"
        if self.sigmoid:
            self.e_score_correction_bias = nn.Parameter(torch.empty(routing.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        if self.sigmoid:
            return v3_topk(logits, self.e_score_correction_bias.float(), self.routing)
        return v2_topk(logits, self.routing)


class DeepseekMoE(nn.Module):
    """Called as the dense MLP is: forward(x [T, H], fp) -> [T, H]."""

    geglu = False

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        routing = cfg.mla.moe
        self.gate = DeepseekRouter(routing, cfg.hidden_size)
        self.experts = MoEExperts(routing.num_experts, cfg.hidden_size, routing.moe_intermediate_size, layer)
        self.shared_experts = None
        if routing.num_shared_experts:
            width = routing.moe_intermediate_size * routing.num_shared_experts
            self.shared_experts = MLP(dataclasses.replace(cfg, intermediate_size=width))

    def forward(self, x: torch.Tensor, fp) -> torch.Tensor:
        ids, weights = self.gate.forward(x)
        out = self.experts.forward(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts.forward(x, fp)
        return out
