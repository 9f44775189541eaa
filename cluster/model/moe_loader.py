"""A sparse layer's checkpoint tensors onto `SparseMoeBlock`'s names (cluster/model/moe.py).

Per-expert tensors (what transformers saves: `mlp.experts.{e}.gate_proj/up_proj/down_proj`, and
Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`) are stacked into gate_up [E, 2I, H] and down
[E, H, I]; checkpoints that already store them stacked (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I], transformers 5's in-memory layout) are taken as they are."""
from __future__ import annotations

import torch

from cluster.model.model_config import ModelConfig

# (the block's checkpoint name, the per-expert names of gate, up and down)
_QWEN = ("mlp", ("gate_proj", "up_proj", "down_proj"))
_MIXTRAL = ("block_sparse_moe", ("w1", "w3", "w2"))


def moe_layer_state_dict(cfg: ModelConfig, take, hf_prefix: str, our_prefix: str) -> dict[str, torch.Tensor]:
    """The router, stacked experts and shared expert of one sparse layer. `take(name)` fetches
    a tensor (and records a miss, see loader.TensorTaker)."""
    block, (gate, up, down) = _MIXTRAL if cfg.architecture == "MixtralForCausalLM" else _QWEN
    src, dst = f"{hf_prefix}{block}.", f"{our_prefix}mlp."
    out = {dst + "gate.weight": take(src + "gate.weight")}
    experts = src + "experts."
    if experts + "gate_up_proj" in take.hf:   # stored stacked already
        out[dst + "experts.gate_up"] = take(experts + "gate_up_proj")
        out[dst + "experts.down"] = take(experts + "down_proj")
    else:
        parts = [[take(f"{experts}{e}.{p}.weight") for p in (gate, up, down)] for e in range(cfg.moe.num_experts)]
        if all(t.numel() for trio in parts for t in trio):   # else the misses are recorded: one error names them
            out[dst + "experts.gate_up"] = torch.stack([torch.cat(trio[:2]) for trio in parts])
            out[dst + "experts.down"] = torch.stack([trio[2] for trio in parts])
    if cfg.moe.shared_expert_intermediate_size:
        shared = src + "shared_expert."
        out[dst + "shared_expert.gate_up_proj.weight"] = torch.cat(
            [take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")])
        out[dst + "shared_expert.down_proj.weight"] = take(shared + "down_proj.weight")
    if cfg.moe.shared_expert_gate:
        out[dst + "shared_expert_gate.weight"] = take(src + "shared_expert_gate.weight")
    return out
