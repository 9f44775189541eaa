"""Speculative decoding's settings (`SpeculativeConfig`, a part of `EngineConfig`), and online
adaptation's (`--spec-online`, decode/spec/online/)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.config_fields import require, setting
from cluster.model.model_paths import (DEFAULT_DRAFT_DIR, DEFAULT_EAGLE_DIR, DEFAULT_MODEL_BLOCK_DIR,
                                       DEFAULT_MODEL_EAGLE_DIR, STDLIB_CODER_DIR)

SPEC_METHODS = ("off", "ngram", "jacobi", "draft", "eagle", "quantspec", "block", "mtp")
QUANTSPEC_KV_VIEWS = ("full", "int4")   # full: the draft reads the KV as the target does
AUTO = "auto"
# The most tokens any proposer is asked for: the ceiling of `max_speculative_tokens` and of a
# request's own k (SamplingParams).
MAX_SPECULATIVE_TOKENS = 16


def parse_lookahead(value: str | int) -> int | str:
    """`--num-speculative-tokens` accepts an integer or 'auto'."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool):
        raise ValueError(f"expected an integer or 'auto', got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected an integer or 'auto', got {value!r}") from None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: which proposer the engine loads and how many tokens it proposes.
    Requests may turn it off, pick n-gram (always available, model-free) or change k."""

    method: str = setting("off", "speculative decoding proposer (with generate --server: the request's, "
                                 "default the server's)", flag="--speculative", choices=SPEC_METHODS)
    num_speculative_tokens: int | str = setting(4, "tokens proposed per step, or 'auto' for dynamic lookahead",
                                                parse=parse_lookahead, metavar="K|auto")
    max_speculative_tokens: int = setting(8, f"the cap of 'auto' and of a request's own k (at most "
                                             f"{MAX_SPECULATIVE_TOKENS})")
    draft_model: Path | None = setting(None, "draft model directory for --speculative draft",
                                       default_text="the built-in model's draft")
    eagle_head: Path | None = setting(None, "EAGLE head directory for --speculative eagle",
                                      default_text="the built-in model's head")
    block_drafter: Path | None = setting(None, "block drafter directory for --speculative block (a DFlash-style "
                                               "drafter: one pass proposes the whole draft)",
                                         default_text="the default model's drafter")
    quantspec_kv_view: str = setting("full", "how --speculative quantspec's draft reads the target's KV: as the "
                                             "target does, or an int8 cache through its int4 view (the QuantSpec "
                                             "paper's; it cost a quarter of the acceptance, docs/quantization.md)",
                                     choices=QUANTSPEC_KV_VIEWS)
    ngram_min: int = setting(2, "the shortest n-gram the n-gram proposer matches")
    ngram_max: int = setting(4, "the longest n-gram the n-gram proposer matches")
    # "auto": cost of a draft step relative to a target step before it is measured (model
    # proposers), and the cost of one more verified position (n-gram, which drafts for free).
    draft_cost_prior: float = setting(0.25, "'auto': a draft step's cost relative to a target step until measured")
    ngram_cost: float = setting(0.1, "'auto': the cost of one more verified position with the n-gram proposer")
    spec_tree_budget: int = setting(0, "token-tree verification: rows per step a drafter may add beside its "
                                       "chains, verified in the same pass (greedy requests): the eagle and "
                                       "quantspec drafts' runner-up tokens, prompt lookup's other matches; "
                                       "'auto' requests' steps measure whether they pay; 0: chains only")
    spec_tree_min_gain: float = setting(0.05, "a model drafter's tree row is verified only if it is expected to add "
                                              "at least this many tokens (the draft's chance of reaching it times "
                                              "the runner-up's)")
    spec_fixed_k_policy: bool = setting(False, "greedy requests that name no k get, per batch size, the server's "
                                               "--num-speculative-tokens or plain decoding, whichever measures "
                                               "faster (off: always the server's k; 'auto' requests are measured "
                                               "either way; docs/spec.md)")
    # Online adaptation (decode/spec/online/): the EAGLE head learns from served traffic, per tenant.
    spec_online: bool = setting(False, "online adaptation of the EAGLE head: decode workers keep a bounded buffer of "
                                       "opted-in tenants' served tokens and features, a low-priority trainer fine-tunes "
                                       "a per-tenant head, promotes it only if it beats the live head on held-out recent "
                                       "traffic, and rolls back a head whose live acceptance falls below the one before "
                                       "(docs/spec.md)")
    spec_online_tenants: str = setting("*", "the tenants whose traffic trains (comma-separated API-key tenant names; "
                                            "'*': every tenant; '' for requests without an API key)")
    spec_online_buffer_tokens: int = setting(65536, "per tenant, the most served tokens a decode worker keeps for "
                                                    "training (the oldest go first)")
    spec_online_min_tokens: int = setting(2048, "the fewest new tokens a tenant must have served before a training round")
    spec_online_steps: int = setting(60, "optimizer steps per training round")
    spec_online_window: int = setting(200, "verification steps in one evaluation window of a promoted head (rolled back "
                                           "if its acceptance over the window is below the previous head's)")
    spec_online_interval_s: float = setting(5.0, "seconds between the trainer's polls of the decode workers")
    spec_online_dir: Path | None = setting(None, "where promoted heads are written (one directory per tenant and "
                                                 "version); none: nothing is written to disk")

    def __post_init__(self) -> None:
        require(self.method in SPEC_METHODS, "method", f"must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        require(isinstance(self.max_speculative_tokens, int) and 1 <= self.max_speculative_tokens
                <= MAX_SPECULATIVE_TOKENS, "max_speculative_tokens",
                f"must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.max_speculative_tokens!r}")
        k = self.num_speculative_tokens
        require(k == AUTO or (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= self.max_speculative_tokens),
                "num_speculative_tokens", f"must be 'auto' or an integer in [1, {self.max_speculative_tokens}] "
                                          f"(max_speculative_tokens), got {k!r}")
        require(self.quantspec_kv_view in QUANTSPEC_KV_VIEWS, "quantspec_kv_view",
                f"must be one of {', '.join(QUANTSPEC_KV_VIEWS)}, got {self.quantspec_kv_view!r}")
        require(1 <= self.ngram_min <= self.ngram_max, "ngram_min",
                f"must be >= 1 and <= ngram_max ({self.ngram_max}), got {self.ngram_min}")
        require(self.draft_cost_prior > 0, "draft_cost_prior", f"must be > 0, got {self.draft_cost_prior}")
        require(self.ngram_cost > 0, "ngram_cost", f"must be > 0, got {self.ngram_cost}")
        require(isinstance(self.spec_tree_budget, int) and 0 <= self.spec_tree_budget <= 64, "spec_tree_budget",
                f"must be an integer in [0, 64], got {self.spec_tree_budget!r}")
        require(0 <= self.spec_tree_min_gain <= 1, "spec_tree_min_gain",
                f"must be in [0, 1], got {self.spec_tree_min_gain}")
        for name in ("spec_online_buffer_tokens", "spec_online_min_tokens", "spec_online_steps", "spec_online_window"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                    f"must be a positive integer, got {value!r}")
        require(self.spec_online_interval_s > 0, "spec_online_interval_s",
                f"must be > 0, got {self.spec_online_interval_s}")
        require(not self.spec_online or self.method == "eagle", "spec_online",
                f"adapts an EAGLE head: it needs --speculative eagle, got {self.method!r}")
        for name in ("draft_model", "eagle_head", "block_drafter", "spec_online_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))

    @property
    def draft_dir(self) -> Path:
        return self.draft_model or DEFAULT_DRAFT_DIR

    def online_tenants(self) -> frozenset[str] | None:
        """`spec_online_tenants` parsed: the names, or None for every tenant ('*')."""
        names = frozenset(t.strip() for t in self.spec_online_tenants.split(","))
        return None if "*" in names else names

    def online_tenant(self, tenant: str) -> bool:
        """Whether `tenant`'s traffic trains its own online head (`spec_online_tenants`)."""
        names = self.online_tenants()
        return self.spec_online and (names is None or tenant in names)

    def block_dir_for(self) -> Path:
        """The drafter --speculative block loads: --block-drafter, else the default model's
        (compat.py refuses it for any other weights)."""
        return self.block_drafter or DEFAULT_MODEL_BLOCK_DIR

    def eagle_dir_for(self, model: Path) -> Path:
        """The head --speculative eagle loads: --eagle-head, else the built-in one of the model
        (stdlib-coder's, or the default model's; compat.py refuses it for any other weights)."""
        if self.eagle_head is not None:
            return self.eagle_head
        return DEFAULT_EAGLE_DIR if Path(model).resolve() == STDLIB_CODER_DIR.resolve() else DEFAULT_MODEL_EAGLE_DIR
