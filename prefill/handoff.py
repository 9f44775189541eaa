"""The prefill side of a P/D handoff: `PrefillHandoff`, the one owner of the blocks of finished
`hold_kv` requests, from the engine's hold through the lease to their release.

The engine is built with it (`LLMEngine(config, hold_factory=PrefillHandoff)`) and calls it as its
`HoldHook` (cluster/engine/hooks.py): when a `hold_kv` request finishes with its first token the
engine gives it the request's blocks, and when a fork of it draws its first token the hook keeps
that delta. One `PrefillLease` record per request holds its blocks, token count and state
(`HoldState`), and once published its `KVHandle` (the lease, and the first tokens of the request
and its forks: the one place they live). `publish_first` (the prefill worker calls it on the
engine thread, in the turn the prefill ends) decides whether a decode worker must continue, publishes the blocks through
the `KVProducer` (cluster/transfer/producer.py: the wire protocol only) or frees them at once; the
producer reports the lease's end (`lease_ended`) and the blocks go back to the pool.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace

from cluster.engine.engine import LLMEngine
from cluster.engine.sequence import Sequence
from cluster.errors import WorkerBusy
from cluster.transfer.producer import KVProducer, LeaseState
from cluster.types import FinishReason, ForkFirst, KVHandle, SamplingParams, TokenDelta

log = logging.getLogger(__name__)


class HoldState(enum.Enum):
    HELD = "held"          # the prefill ended: its blocks are kept, not yet published
    LEASED = "leased"      # published under a lease: a consumer may read them until it ends


@dataclass
class PrefillLease:
    """A finished `hold_kv` request's prompt KV, kept for its consumer: the one record of it."""
    request_id: str
    block_ids: list[int]
    num_tokens: int
    seq: Sequence        # what the speculator exports for it (`spec_state`) is set by the end of its last step
    state: HoldState = HoldState.HELD
    handle: KVHandle | None = None   # once published: the lease, and the first tokens it carries


class PrefillHandoff:
    """Blocks held outside the scheduler, by request id, until `release` frees them."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.leases: dict[str, PrefillLease] = {}
        self._fork_firsts: dict[str, list[TokenDelta]] = {}

    # --- the engine's HoldHook -----------------------------------------------------------------
    def hold(self, seq: Sequence) -> None:
        self.leases[seq.request_id] = PrefillLease(seq.request_id, seq.block_ids, seq.num_computed_tokens, seq)

    def fork_first(self, parent_id: str, delta: TokenDelta) -> None:
        self._fork_firsts.setdefault(parent_id, []).append(delta)

    # --- the prefill worker's ------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self.leases

    def take(self, request_id: str) -> tuple[list[int], int]:
        """Blocks and token count of a finished `hold_kv` request; they stay referenced until
        `release`."""
        held = self.leases[request_id]
        return held.block_ids, held.num_tokens

    def release(self, request_id: str) -> None:
        held = self.leases.pop(request_id)
        self.engine.pool.free(reversed(held.block_ids))

    def lease_ended(self, request_id: str, state: LeaseState) -> None:
        """On the engine thread: the producer ended the lease (DONE, aborted, failed, expired)."""
        held = self.leases.get(request_id)
        if held is not None and held.state is HoldState.LEASED:
            log.debug("lease %s of %s ended %s", held.handle.lease_id, request_id, state.value)
            self.release(request_id)

    def take_feature(self, request_id: str) -> bytes:
        """The proposer state the blocks do not carry, as the engine's speculator exports it (with
        an EAGLE head: the target's hidden state at the prompt's last position); b"" when none."""
        held = self.leases.get(request_id)
        return b"" if held is None else self.engine.speculator.export_state(held.seq)

    def take_fork_firsts(self, request_id: str) -> list[TokenDelta]:
        """A `hold_kv` request's forks, each ended with its first token (drawn from the prompt's
        logits beside the request's own): what a decode worker continues them from."""
        return self._fork_firsts.pop(request_id, [])

    def publish(self, producer: KVProducer, request_id: str, first_token: int,
                forks: tuple[TokenDelta, ...] = ()) -> bytes:
        """Put the held blocks under a lease: the encoded handle a decode worker pulls from, with
        the first token of the request and of each fork that drew one (`forks`: their deltas)."""
        held = self.leases[request_id]
        if self.engine.kv_export is not None:   # a TP worker: every rank's heads into the arena published
            self.engine.kv_export.gather(held.block_ids)
        handle = producer.publish(request_id, held.block_ids, held.num_tokens, first_token)
        handle = replace(handle, feature=self.take_feature(request_id),
                         forks=tuple(ForkFirst(d.request_id, d.token_ids[0]) for d in forks if d.token_ids),
                         cache_offset=held.seq.compaction_offset)   # a compacted prompt: fewer blocks
        held.state, held.handle = HoldState.LEASED, handle
        return handle.encode()


@dataclass(frozen=True)
class FirstToken:
    """What a prefill ended with: its last delta, its forks' first deltas, and the encoded handle
    when a decode worker must continue (None: every sample ended with its first token)."""
    last: TokenDelta
    reason: FinishReason | None
    forks: tuple[TokenDelta, ...]
    handle: bytes | None


def first_reason(e: LLMEngine, last: TokenDelta, sampling: SamplingParams) -> FinishReason | None:
    """Why a request ends with its first token (None: a decode worker continues it)."""
    if last.finish_reason in (FinishReason.STOP, FinishReason.ABORT):
        return last.finish_reason
    if sampling.max_tokens == 1 or last.num_prompt_tokens + 1 >= e.max_model_len:
        return FinishReason.LENGTH
    return None


def publish_first(hold: PrefillHandoff, producer: KVProducer, request_id: str, prompt_ids: list[int],
                  sampling: SamplingParams, last: TokenDelta, forks: dict[str, SamplingParams],
                  export: bool = False) -> FirstToken:
    """On the engine thread, in the turn that finished the prefill: the lease starts and the
    handle leaves at once, not a step later. `export`: the blocks are published even though the
    request ended (a prefix another worker reads)."""
    e = hold.engine
    firsts = tuple(replace(d, finish_reason=first_reason(e, d, forks[d.request_id]))
                   for d in hold.take_fork_firsts(request_id))
    if not last.token_ids and last.finish_reason is not FinishReason.ABORT:
        # Ended for lack of blocks before its first token: nothing to hand off, nothing kept.
        if request_id in hold:
            hold.release(request_id)
        need = -(-len(prompt_ids) // e.layout.block_size)
        raise WorkerBusy(f"prefill of {request_id} ended without a first token: its prompt needs {need} KV "
                         f"blocks and this worker has {e.pool.num_blocks} in the pool "
                         f"({e.pool.num_free} free); try another worker")
    reason = first_reason(e, last, sampling)
    handle = None
    if request_id in hold:
        if reason is not None and all(d.finish_reason is not None for d in firsts) and not export:
            hold.release(request_id)
        else:
            handle = hold.publish(producer, request_id, last.token_ids[0], firsts)
    return FirstToken(last, reason, firsts, handle)
