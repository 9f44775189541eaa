"""The expert balancer's settings (`ExpertBalanceConfig`, a part of `EngineConfig`): vLLM's flag
names (`--enable-eplb`, `--num-redundant-experts`, `--eplb-step-interval`); the rule per role is
ours (cluster/parallel/expert_placement.py, docs/parallel.md)."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config_fields import derived, require, setting

EPLB_POLICIES = ("auto", "global", "hierarchical")


@dataclass(frozen=True)
class ExpertBalanceConfig:
    enable_eplb: bool = setting(False, "with --enable-expert-parallel: move and replicate experts between the ranks "
                                       "from their measured load, between steps (docs/parallel.md)")
    num_redundant_experts: int = setting(0, "extra expert slots per sparse layer, over all ranks, that the balancer "
                                            "fills with replicas of the hottest experts")
    eplb_step_interval: int = setting(1000, "forward passes between two looks at the experts' load")
    eplb_policy: str = setting("auto", "the placement rule: hierarchical (expert groups onto nodes first) or global; "
                                       "auto: hierarchical for prefill workers, global for decode (DeepSeek's advice)",
                               choices=EPLB_POLICIES)
    eplb_min_gain: float = setting(0.05, "a new placement is applied only when it cuts the busiest rank's share of "
                                         "the measured load by at least this fraction")
    role: str = derived("decode", "the worker's role (prefill, decode; colocated: decode): picks the auto rule")

    def __post_init__(self) -> None:
        require(self.num_redundant_experts >= 0, "num_redundant_experts",
                f"must be >= 0, got {self.num_redundant_experts}")
        require(self.eplb_step_interval >= 1, "eplb_step_interval", f"must be >= 1, got {self.eplb_step_interval}")
        require(0 <= self.eplb_min_gain < 1, "eplb_min_gain", f"must be in [0, 1), got {self.eplb_min_gain}")

    @property
    def policy(self) -> str:
        """The rule this worker uses: `eplb_policy`, with auto resolved by the role."""
        if self.eplb_policy != "auto":
            return self.eplb_policy
        return "hierarchical" if self.role == "prefill" else "global"
