"""The router's settings (`RouterConfig`): when to prefill on the decode worker, how long to wait
for a worker or for a stream's last tokens, how many attempts a request gets. Its own module so
that the router's parts (`router.py`, `worker_pool.py`, `attempts.py`) all read it without
importing each other."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config import derived, require, setting


@dataclass
class RouterConfig:
    block_size: int = derived(16, "the engines' KV block size (--block-size): the policy hashes prompts by block")
    colocated: bool = derived(False, "--colocated: every worker runs both phases")
    local_prefill_max_tokens: int = setting(32, "prompts this short are prefilled on the decode worker "
                                                "(conditional disaggregation)")
    local_prefill_cached_fraction: float = setting(0.9, "... and so are prompts this much of which is cached there")
    final_delta_grace_s: float = setting(30.0, "after a stream's worker call returns, its last tokens must arrive "
                                               "within this")
    stall_timeout_s: float = setting(60.0, "route around a live worker that has work queued but has made no engine "
                                           "step for this long, until it moves again (a slow worker is never "
                                           "routed around)")
    unavailable_wait_s: float = setting(120.0, "how long a request waits for a routable worker of a role (the "
                                               "cluster starting, or every such worker restarting)")
    max_attempts: int = setting(8, "decode attempts per request (failovers and busy retries)")
    kv_events_period_s: float = setting(0.5, "how often the router reads the workers' KV events (its cluster-wide "
                                             "index of the blocks each worker's pool and tiers hold)")
    kv_index_stale_s: float = setting(5.0, "a worker whose KV events could not be read for this long is routed on "
                                           "load alone, never on its last known cached blocks, until they arrive")
    prefix_fetch: str = setting("auto", "a prompt mostly cached on a prefill worker (its pool or KV tiers, e.g. on "
                                        "another node) but not on the decode worker: pull those blocks from it when "
                                        "that is measured to be cheaper than computing them (auto), never (off), "
                                        "or whenever it holds them (always)", choices=("auto", "off", "always"))

    def __post_init__(self) -> None:
        require(self.local_prefill_max_tokens >= 0, "local_prefill_max_tokens",
                f"must be >= 0, got {self.local_prefill_max_tokens}")
        require(0 <= self.local_prefill_cached_fraction <= 1, "local_prefill_cached_fraction",
                f"must be in [0, 1], got {self.local_prefill_cached_fraction}")
        for name in ("final_delta_grace_s", "stall_timeout_s", "unavailable_wait_s", "kv_events_period_s",
                     "kv_index_stale_s"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(self.max_attempts >= 1, "max_attempts", f"must be >= 1, got {self.max_attempts}")
