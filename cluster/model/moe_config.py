"""The mixture-of-experts part of a model's shape, read from `config.json` (Qwen2-MoE, Qwen3-MoE,
Mixtral), with refusals that name what the MoE code lacks.

Which layers are sparse: Qwen's rule, a layer is MoE unless it is in `mlp_only_layers` or its
(index + 1) is not a multiple of `decoder_sparse_step`; Mixtral's layers are all MoE. The other
layers keep the dense MLP of `intermediate_size`."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")

# MoE architectures we know and refuse, with the reason (DeepSeek V2/V3 live in their own module).
REFUSED_MOE_ARCHITECTURES = {
    a: f"{a}: this mixture-of-experts family is not supported (supported: {', '.join(MOE_ARCHITECTURES)})"
    for a in ("PhimoeForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM", "Qwen3NextForCausalLM",
              "JambaForCausalLM", "DbrxForCausalLM", "JetMoeForCausalLM", "GptOssForCausalLM",
              "Llama4ForCausalLM", "Ernie4_5_MoeForCausalLM", "HunYuanMoEV1ForCausalLM")
}


class Routing(Enum):
    """How router logits become (expert ids, weights): both take the softmax over all experts
    in float32 and keep the top k; they differ in what the weights are rounded to."""
    SOFTMAX_TOPK = "softmax_topk"   # Qwen: renormalized when norm_topk_prob, then in the model's dtype
    MIXTRAL = "mixtral"             # always renormalized, kept in float32


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    routing: Routing
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]        # per layer: True where the MLP is the expert block
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE's always-on expert (0: none)
    shared_expert_gate: bool = False           # its output scaled by sigmoid(x @ gate) (Qwen2-MoE)

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]

    def mlp_parameters(self, hidden: int, dense_intermediate: int, active: bool = False) -> int:
        """Parameters of all layers' MLPs (routers included); `active`: only the top-k experts'."""
        experts = self.top_k if active else self.num_experts
        sparse = (experts * 3 * hidden * self.expert_intermediate_size + self.num_experts * hidden
                  + 3 * hidden * self.shared_expert_intermediate_size + (hidden if self.shared_expert_gate else 0))
        return sum(sparse if s else 3 * hidden * dense_intermediate for s in self.sparse_layers)


def parse_moe_config(raw: dict, arch: str, n_layers: int) -> MoEConfig | None:
    """The MoE shape of an architecture in MOE_ARCHITECTURES; None for a dense one."""
    if arch not in MOE_ARCHITECTURES:
        return None
    _refuse_unsupported_moe(raw, arch)
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok", 0))
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"{arch}: num_experts ({experts}) and num_experts_per_tok ({top_k}) must be "
                         "positive with num_experts_per_tok <= num_experts")
    if arch == "MixtralForCausalLM":
        return MoEConfig(experts, top_k, int(raw["intermediate_size"]), Routing.MIXTRAL, True,
                         (True,) * n_layers)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    shared = int(raw.get("shared_expert_intermediate_size", 0) or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(experts, top_k, int(raw["moe_intermediate_size"]), Routing.SOFTMAX_TOPK,
                     bool(raw.get("norm_topk_prob", False)), sparse, shared, shared > 0)


def _refuse_unsupported_moe(raw: dict, arch: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: experts with activation {raw.get('hidden_act')!r} (hidden_act) are not "
                         "supported: the expert compute is SiLU-gated")
    if arch != "MixtralForCausalLM" and "moe_intermediate_size" not in raw:
        raise ValueError(f"config.json of {arch} lacks required field 'moe_intermediate_size'")
    if arch != "MixtralForCausalLM" and raw.get("use_sliding_window"):
        raise ValueError(f"sliding-window attention on {arch} (use_sliding_window) is not supported")
