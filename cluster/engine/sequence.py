"""A request inside the engine: a small mutable record, and its life-cycle states."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from cluster.kv.hashing import BlockHash
from cluster.kv.window import KVWindow
from cluster.types import FinishReason, KVCompaction, SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued, holds no blocks (new, or preempted and to be recomputed)
    RUNNING = "running"      # in the batch, holds blocks
    FINISHED = "finished"    # done; its blocks are back in the pool


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)     # prompt + output
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0                           # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # keys of full blocks, by position
    num_published_blocks: int = 0                          # leading blocks offered to the prefix cache
    num_cached_tokens: int = 0                             # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    hold_kv: bool = False                                  # keep the blocks after finishing (P/D producer)
    queued_at: float = field(default_factory=time.monotonic)   # for the queue-time metric
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # prompt tokens 1.. (prompt_logprobs)
    prompt_logprobs_sent: bool = False
    # n > 1: the other samples of this prompt, waiting for its first sampling to share its KV.
    forks: list["Sequence"] = field(default_factory=list)
    # What the engine's speculator keeps on the request (decode/spec/: the EAGLE head's feature);
    # it outlives the request's end, since a P/D producer exports it after the last step.
    spec_state: object | None = None
    tenant: str = ""     # the API key's tenant: per-tenant state beside the KV (decode/spec/online/)
    grammar: object | None = None   # its structured-output matcher (cluster/engine/grammar.py), or None
    # Attention sinks with a window (cluster/kv/window.py): `block_ids` then holds the live blocks
    # only (sinks, then the window); `num_dropped_blocks` logical blocks between them were freed.
    kv_window: KVWindow | None = None
    num_dropped_blocks: int = 0
    # KV compaction of its prompt (cluster/engine/compaction.py): what it asks for; the prompt's last
    # queries captured per chunk (one tensor per layer); once compacted, `compaction_offset` prompt
    # tokens' KV are not in its table (its later positions sit `compaction_offset` cache indices lower).
    kv_compaction: KVCompaction | None = None
    captured: list[list[torch.Tensor]] = field(default_factory=list)
    compacted: bool = False
    compaction_offset: int = 0
    tiers_checked: bool = False   # the KV tiers were asked for its prompt's blocks (engine._prefetch_next)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def cache_offset(self) -> int:
        """Tokens between a windowed sequence's sinks and its window whose KV was freed (its
        position p sits at cache index p - cache_offset past the sinks), or the prompt tokens a
        compacted sequence's table leaves out (every later position p at p - cache_offset)."""
        dropped = self.num_dropped_blocks * self.kv_window.block_size if self.num_dropped_blocks else 0
        return dropped + self.compaction_offset

    @property
    def max_prefix_tokens(self) -> int:
        """Tokens a prefix-cache hit may cover: all but the last (its logits are computed), and
        for a sequence still to compact none of the prompt's observed queries (they are captured)."""
        spec = self.kv_compaction
        if spec is None or self.compacted:
            return self.num_tokens - 1
        return max(0, min(self.num_tokens - 1, self.num_prompt_tokens - spec.observed))

    @property
    def reindexed(self) -> bool:
        """Its cache indices may differ from its positions (windowed or compacting)."""
        return self.kv_window is not None or self.kv_compaction is not None or self.compacted

    def live_block(self, logical: int) -> int:
        """The block id holding logical block `logical` (one still live)."""
        if self.num_dropped_blocks and logical >= self.kv_window.sink_blocks:
            logical -= self.num_dropped_blocks
        return self.block_ids[logical]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet."""
        return (self.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The prompt logprobs, once (on the request's first delta that carries a token)."""
        if self.prompt_logprobs_sent or self.wants_prompt_logprobs:
            return ()
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
