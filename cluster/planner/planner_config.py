"""The planner's settings (`--planner sla --ttft-slo S --itl-slo S --max-workers N
--planner-interval S`): off by default."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config_fields import require, setting

PLANNERS = ("off", "sla")


@dataclass(frozen=True)
class PlannerConfig:
    mode: str = setting("off", "size the prefill and decode pools to meet --ttft-slo and --itl-slo (sla), or keep "
                               "--prefill/--decode as started (off)", flag="--planner", choices=PLANNERS)
    ttft_slo_s: float = setting(2.0, "the planner's time-to-first-token target, seconds", flag="--ttft-slo")
    itl_slo_s: float = setting(0.1, "the planner's inter-token latency target, seconds", flag="--itl-slo")
    max_workers: int = setting(8, "the most prefill + decode workers the planner may run")
    interval_s: float = setting(30.0, "how often the planner decides", flag="--planner-interval")
    profile: str | None = setting(None, "the workers' step costs as a device profile (JSON, bench/planner_profile.py)",
                                  flag="--planner-profile", metavar="FILE",
                                  default_text="cluster/planner/cpu-default.json, rescaled by the workers' "
                                               "measured costs")

    def __post_init__(self) -> None:
        require(self.mode in PLANNERS, "mode", f"must be one of {', '.join(PLANNERS)}, got {self.mode!r}")
        for name in ("ttft_slo_s", "itl_slo_s", "interval_s"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(self.max_workers >= 2, "max_workers", f"must be >= 2 (a prefill and a decode worker), got "
                                                      f"{self.max_workers}")
