"""What the engine tells the roles: the hooks a worker builds its engine with.

The engine is role-neutral: a prefill worker's side of the P/D handoff (prefill/handoff.py) is a
`HoldHook`, built with the engine (`LLMEngine(config, hold_factory=...)`); speculation (decode/spec/) is a `Speculator` (cluster/engine/speculation.py), given
to the engine by its factory (`LLMEngine(config, speculator_factory=...)`); the
decode side of the handoff (decode/handoff.py) adds sequences through `LLMEngine.new_sequence`.
"""
from __future__ import annotations

from typing import Protocol

from cluster.engine.sequence import Sequence
from cluster.types import TokenDelta


class HoldHook(Protocol):
    """Keeps the prompt KV of `hold_kv` requests for a consumer (a decode worker that pulls it)."""

    def hold(self, seq: Sequence) -> None:
        """`seq`, a `hold_kv` request, finished with its KV in `seq.block_ids` (its first
        `seq.num_computed_tokens` tokens): the hook takes the blocks (the engine forgets them) and
        frees them into the pool once the consumer is done. What the engine's speculator keeps on
        the sequence for a handoff (`Speculator.export_state`) is set by the end of the step."""

    def fork_first(self, parent_id: str, delta: TokenDelta) -> None:
        """A fork of `hold_kv` request `parent_id` drew its first token and ended here (`delta`):
        what a decode worker continues it from."""
