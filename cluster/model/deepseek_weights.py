"""DeepSeek checkpoints' tensor names onto `deepseek.py`'s: gate and up fused (dense MLP, shared
experts), kv_b_proj kept whole (prefill) and split per head (the absorbed decode's W_UK, W_UV),
routed experts stacked as `MoEExperts` holds them (gate_up [E, 2I, H], down [E, H, I])."""
from __future__ import annotations

import torch

from cluster.model.model_config import ModelConfig

_ATTENTION_LOW_RANK_Q = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")


def _attention(cfg: ModelConfig, take, a: str, ours: str) -> dict[str, torch.Tensor]:
    mla = cfg.mla
    names = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    names += ["q_proj.weight"] if mla.q_lora_rank is None else list(_ATTENTION_LOW_RANK_Q)
    if mla.attention_bias:
        names += ["kv_a_proj_with_mqa.bias", "o_proj.bias"] + ([] if mla.q_lora_rank is None else ["q_a_proj.bias"])
    out = {ours + n: take(a + n) for n in names}
    kv_b = out[ours + "kv_b_proj.weight"]
    if kv_b.numel():
        per_head = kv_b.view(cfg.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        out[ours + "w_uk"] = per_head[:, :mla.qk_nope_head_dim].contiguous()
        out[ours + "w_uv"] = per_head[:, mla.qk_nope_head_dim:].contiguous()
    return out


def _gate_up(take, prefix: str) -> torch.Tensor:
    return torch.cat([take(prefix + "gate_proj.weight"), take(prefix + "up_proj.weight")])


def _mlp(cfg: ModelConfig, take, m: str, ours: str, index: int) -> dict[str, torch.Tensor]:
    if not cfg.mla.layer_is_moe(index):
        return {ours + "gate_up_proj.weight": _gate_up(take, m), ours + "down_proj.weight": take(m + "down_proj.weight")}
    moe = cfg.mla.moe
    out = {ours + "gate.weight": take(m + "gate.weight")}
    if moe.scoring == "sigmoid":
        out[ours + "gate.e_score_correction_bias"] = take(m + "gate.e_score_correction_bias")
    if moe.num_shared_experts:
        s = m + "shared_experts."
        out[ours + "shared_experts.gate_up_proj.weight"] = _gate_up(take, s)
        out[ours + "shared_experts.down_proj.weight"] = take(s + "down_proj.weight")
    out.update(_experts(take, m + "experts.", ours + "experts.", moe.num_experts))
    return out


def _experts(take, hf: str, ours: str, num_experts: int) -> dict[str, torch.Tensor]:
    """Stacked [E, 2I, H] and [E, H, I]: as transformers 5 saves them, or per expert as the
    original checkpoints do."""
    if hf + "gate_up_proj" in take.hf:
        return {ours + "gate_up": take(hf + "gate_up_proj"), ours + "down": take(hf + "down_proj")}
    gate_up = [_gate_up(take, f"{hf}{e}.") for e in range(num_experts)]
    down = [take(f"{hf}{e}.down_proj.weight") for e in range(num_experts)]
    if any(not t.numel() for t in (*gate_up, *down)):   # the misses are recorded: one error names them
        return {}
    return {ours + "gate_up": torch.stack(gate_up), ours + "down": torch.stack(down)}


def deepseek_layer_state_dict(cfg: ModelConfig, take, hf_prefix: str, our_prefix: str,
                              index: int) -> dict[str, torch.Tensor]:
    out = _attention(cfg, take, hf_prefix + "self_attn.", our_prefix + "self_attn.")
    out.update(_mlp(cfg, take, hf_prefix + "mlp.", our_prefix + "mlp.", index))
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[our_prefix + name] = take(hf_prefix + name)
    return out
