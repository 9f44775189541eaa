"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every step shares one token budget. Running requests go first, in admission order: a decode
takes one token, a request still in prefill takes the next chunk of its prompt. Waiting requests
are then admitted while budget, sequence slots and blocks last; a new request first takes every
cached full block of its prompt and computes only the rest. When a running request needs a block
and none is free, the most recently admitted request is preempted (its blocks freed, its tokens
recomputed later), so the oldest request always progresses and the engine cannot deadlock.

When the pool is full, room is made in `room.py`: preemption, and the rules for handed-off (P/D)
requests that wait holding the blocks their KV was pulled into.

Speculative decoding turns a decode into a verification of k+1 positions (`attach_draft`); its
blocks are reserved only from free ones, and `update` keeps the accepted prefix: computed counts
advance over the accepted tokens only and blocks reserved past them go back to the pool.

Tenants share each step by weight (`fair_share.py`): when two or more have work, the step's
budget is `fair_step_tokens` and each tenant gets its share of it (decodes, prefill chunks and
lookahead); a lone tenant gets the whole budget. Sequences skipped in a step keep their blocks.

It counts what the metrics read (`WorkerStats`): each request's time from arrival to its first
schedule, in Prometheus buckets, and preemptions.
"""
from __future__ import annotations

import enum
import time
from bisect import bisect_left
from collections import deque
from itertools import accumulate
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cluster.config import SchedulerConfig
from cluster.engine import room
from cluster.engine.fair_share import FairShare
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.kv.block_pool import BlockPool
from cluster.kv.hashing import BlockHash, hash_prefix_blocks
from cluster.types import FinishReason

# Upper bounds (seconds) of the queue-time histogram a worker reports (`WorkerStats.queue_time_buckets`),
# the same as the router's latency buckets (cluster/metrics.py): fine below a second, where queues usually are.
QUEUE_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                      1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int        # first token position computed this step
    num_tokens: int
    draft: tuple[int, ...] = ()   # proposed tokens verified after the last one (num_tokens = 1 + k)
    tree: tuple[int, ...] = ()    # the draft's parents when it is a token tree (draft_tree.py); () a chain

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence: its last logits are sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


class Gate(enum.Enum):
    """The admission gate's answer for a queued request (`Scheduler.admit_gate`)."""
    ADMIT = "admit"
    HOLD = "hold"      # not yet; the requests behind it may go first
    STOP = "stop"      # not yet, and nobody behind it either


@dataclass
class StepPlan:
    decodes: list[ScheduledChunk] = field(default_factory=list)   # one token each
    prefills: list[ScheduledChunk] = field(default_factory=list)  # chunks of several tokens
    preempted: list[Sequence] = field(default_factory=list)
    stalled: list[Sequence] = field(default_factory=list)   # running, waiting for blocks held outside
    verifies: list[ScheduledChunk] = field(default_factory=list)  # decodes with a draft to verify
    budget_left: int = 0
    shared: bool = False    # tenants contend: each gets its fair share of the step (fair_share.py)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.verifies + self.prefills

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], on_hold: Callable[[Sequence], None] | None = None,
                 hit_filter: Callable[[list[int]], list[int]] | None = None,
                 admit_gate: Callable[[Sequence], Gate] | None = None, fair: FairShare | None = None):
        self.config = config
        # How tenants share steps and slots; by default from the config's weights and fair step budget.
        self.fair = fair if fair is not None else FairShare(config.weights(), config.fair_step_tokens)
        self.pool = pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_positions = max_model_len   # a windowed sequence's limit (builder: the RoPE table's length)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Takes the blocks of a finished `hold_kv` request (the prefill side of a P/D handoff,
        # prefill/handoff.py): they stay referenced, outside the scheduler, until it frees them.
        self.on_hold = on_hold
        self.ended: list[Sequence] = []   # requests the scheduler itself ended (see take_ended)
        # Trims a prefix hit to what the engine can continue from (an EAGLE head needs the hidden
        # state at the hit's last position, kept only for blocks this engine computed).
        self.hit_filter = hit_filter
        # Whether a queued request may be admitted now (engine._prefetch_next: its prefix is still
        # to be asked of the KV tiers): ADMIT, HOLD (it keeps its place, the requests behind it go
        # on: it waits for a load slot) or STOP (nobody behind it goes first: it waits for memory).
        self.admit_gate = admit_gate
        self.queue_seconds = 0.0     # summed time from arrival to first schedule, and its count
        self.queue_count = 0
        self.queue_time_counts = [0] * len(QUEUE_TIME_BUCKETS)   # per bucket (not cumulative); +Inf: the rest
        self.num_preemptions = 0     # requests preempted (blocks freed, to be recomputed)
        self.kv_discarded = 0        # handed-off waiters whose transferred KV was thrown away

    # --- queue -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def take_ended(self) -> list[Sequence]:
        out, self.ended = self.ended, []
        return out

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a request wherever it is and give back its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.fair.forget(seq)
        if seq.hold_kv and reason is not FinishReason.ABORT and seq.block_ids and self.on_hold is not None:
            self.on_hold(seq)      # its blocks and computed count are the hook's now
            seq.block_ids = []
        else:
            self.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # --- blocks for KV that arrives from outside (a P/D pull, decode/handoff.py) -------------------
    def reserve_external(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks for KV another worker sends (NoFreeBlocks when fewer are
        free). They are the caller's until a sequence joins on them (`add`) or it gives them back
        with `release_external`; meanwhile they count as held outside (see room.py)."""
        return self.pool.allocate(num_blocks)

    def release_external(self, blocks: list[int], cache_keys: Iterable[BlockHash] = ()) -> None:
        """Give back blocks of `reserve_external`. `cache_keys`: the leading blocks' prefix keys,
        published to the prefix cache first (a prefix fetched from another worker, checked by the
        transport's checksums)."""
        for block, key in zip(blocks, cache_keys):
            self.pool.cache_block(block, key)
        self.pool.free(reversed(blocks))

    def fork(self, parent: Sequence, child: Sequence, num_prompt: int, copy_block) -> bool:
        """Queue `child` (another sample of `parent`'s prompt, its own first token appended) on the
        parent's prompt KV: the full blocks shared by reference, the partial last block copied
        (`copy_block(src, dst)`), since both go on writing into it. False when no block is free for
        the copy: the caller then queues the child to compute its prompt itself."""
        full, partial = divmod(num_prompt, self.block_size)
        if parent.num_dropped_blocks:
            return False   # its table is no longer the prompt's blocks in order
        own: list[int] = []
        if partial:
            if self.pool.num_free == 0:
                return False
            own = self.pool.allocate(1)
            copy_block(parent.block_ids[full], own[0])
        shared = parent.block_ids[:full]
        self.pool.touch(shared)
        child.block_ids = [*shared, *own]
        child.num_computed_tokens = num_prompt
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_published_blocks = min(parent.num_published_blocks, full)
        child.num_cached_tokens = parent.num_cached_tokens
        self.waiting.append(child)
        return True

    # --- one step ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        shared_budget = self.fair.start_step(self._demand(), budget)
        picks = None
        if shared_budget is not None:
            plan.shared, budget = True, shared_budget
            picks = self.fair.pick(self.running, budget)
        # In admission order even when shared, so that room's preemption (of the youngest) never
        # takes a sequence already in the plan.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue   # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if picks is not None:
                n = min(n, picks.get(seq, 0))
                if n == 0:
                    continue   # past its tenant's share this step: it waits, keeping its blocks
            self.slide_window(seq)
            if not room.reserve(self, seq, seq.num_computed_tokens + n, plan):
                continue
            self._add_chunk(plan, seq, n)
            budget -= n
        if plan.preempted or plan.stalled:
            return plan   # memory is tight: admit nobody new this step
        plan.budget_left = self._admit_waiting(plan, budget)
        return plan

    def _demand(self) -> dict[str, int]:
        """Per tenant, the tokens its running and queued sequences could compute now."""
        demand: dict[str, int] = {}
        for seq in (*self.running, *self.waiting):
            demand[seq.tenant] = demand.get(seq.tenant, 0) + max(1, seq.num_tokens - seq.num_computed_tokens)
        return demand

    def _admit_waiting(self, plan: StepPlan, budget: int) -> int:
        """Admit queued requests in order while the budget, the batch and the pool allow. One the
        gate holds (its KV tiers not asked yet: no free load slot) keeps its place and the ones
        behind it go on; none jumps a request that waits for memory (the pool's, or room to load
        its prefix into: the gate's STOP). Returns the budget left."""
        held = []
        if plan.shared:   # the tenants holding fewest slots per weight first
            ordered = self.fair.admission_order(self.waiting, self.running)
            self.waiting.clear()
            self.waiting.extend(ordered)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            slot_from = None   # a batch full: the sequence `seq`'s tenant may take a slot from
            if len(self.running) >= self.config.max_num_seqs:
                if plan.shared:
                    slot_from = self.fair.slot_to_free(seq, self.running, {c.seq for c in plan.chunks})
                if slot_from is None:
                    break
            gate = Gate.ADMIT if self.admit_gate is None else self.admit_gate(seq)
            if gate is Gate.STOP:
                break
            if gate is Gate.HOLD or self._share(plan, seq, budget) == 0:
                held.append(self.waiting.popleft())
                continue
            if slot_from is not None:
                budget += self._give_slot(slot_from, plan)
            n = self._admit(seq, self._share(plan, seq, budget))
            if n == 0:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_chunk(plan, seq, n)
            budget -= n
        self.waiting.extendleft(reversed(held))
        return budget

    def _share(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        """The tokens a queued `seq` may take this step: its tenant's allowance when shared (a
        whole prompt when prefill is not chunked: its tenant pays it back over later steps)."""
        if not plan.shared:
            return budget
        if not self.config.enable_chunked_prefill:
            return budget if self.fair.allowance(seq.tenant) > 0 else 0
        return min(budget, self.fair.allowance(seq.tenant))

    def _give_slot(self, victim: Sequence, plan: StepPlan) -> int:
        """Preempt `victim` for a queued sequence of a tenant below its share of a full batch (the
        queue's head stays first). Returns the tokens its chunk in this plan gave back."""
        freed = 0
        for chunks in (plan.decodes, plan.prefills):
            for chunk in [c for c in chunks if c.seq is victim]:
                chunks.remove(chunk)
                freed += chunk.num_tokens
        self.fair.charge(victim, -freed)
        self.preempt(victim, plan)
        self.waiting.remove(victim)
        self.waiting.append(victim)
        return freed

    # --- speculation ---------------------------------------------------------------------------
    def lookahead_room(self, seq: Sequence, k: int, plan: StepPlan) -> int:
        """Reserve blocks for up to k draft tokens after `seq`'s pending one, from free blocks only
        and within the step's token budget, the context and max_tokens; returns the k reserved."""
        k = min(k, plan.budget_left, self.max_model_len - seq.num_tokens,
                seq.sampling.max_tokens - seq.num_output_tokens - 1)
        if plan.shared:
            k = min(k, self.fair.allowance(seq.tenant))
        if k <= 0:
            return 0
        # Slots this step writes: the pending token's and k drafts' (positions up to num_tokens + k - 1).
        room = (len(seq.block_ids) + self.pool.num_free) * self.block_size - seq.num_tokens + seq.cache_offset
        k = min(k, room)
        if k <= 0:
            return 0
        need = self.blocks_for(seq.num_tokens + k - seq.cache_offset) - len(seq.block_ids)
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        plan.budget_left -= k
        if plan.shared:
            self.fair.charge(seq, k)
        return k

    def attach_draft(self, plan: StepPlan, chunk: ScheduledChunk, draft: tuple[int, ...],
                     tree: tuple[int, ...] = ()) -> None:
        """Turn a scheduled decode into a verification of its pending token plus `draft` (a chain,
        or a token tree by its parents)."""
        plan.decodes.remove(chunk)
        chunk.draft = tuple(draft)
        chunk.tree = tuple(tree)
        chunk.num_tokens = 1 + len(draft)
        plan.verifies.append(chunk)

    def trim_blocks(self, seq: Sequence) -> None:
        """Give back blocks reserved past what the sequence's tokens need (unused lookahead)."""
        keep = self.blocks_for(seq.num_tokens - seq.cache_offset)
        if len(seq.block_ids) > keep and not seq.is_finished:
            extra = seq.block_ids[keep:]
            del seq.block_ids[keep:]
            self.pool.free(reversed(extra))

    def _add_chunk(self, plan: StepPlan, seq: Sequence, n: int) -> None:
        if plan.shared:
            self.fair.charge(seq, n)
        chunk = ScheduledChunk(seq, seq.num_computed_tokens, n)
        (plan.decodes if n == 1 else plan.prefills).append(chunk)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slide_window(self, seq: Sequence) -> None:
        """Free the blocks a windowed sequence's next query (`num_computed_tokens`) no longer sees
        (cluster/kv/window.py); published when full, they stay in the prefix cache until evicted."""
        window = seq.kv_window
        drop = range(0) if window is None else window.to_drop(seq.num_computed_tokens, seq.num_dropped_blocks)
        if not drop:
            return
        first = window.sink_blocks
        freed = seq.block_ids[first:first + len(drop)]
        del seq.block_ids[first:first + len(drop)]
        seq.num_dropped_blocks += len(drop)
        self.pool.free(reversed(freed))

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take cached prefix blocks and blocks for the first chunk; return its token count (0: not now)."""
        bs = self.block_size
        usable = 0
        handed_off = bool(seq.num_computed_tokens and seq.block_ids)   # KV already in our blocks (P/D)
        # Prompt logprobs need every prompt position computed here, so such a request skips the cache.
        if not handed_off and self.pool.enable_prefix_caching and not seq.wants_prompt_logprobs:
            seq.block_hashes = hash_prefix_blocks(seq.token_ids, bs, seq.sampling.cache_salt, seq.block_hashes)
            # Never reuse the block holding the last token: its logits must be computed.
            usable = seq.max_prefix_tokens // bs
            hits = self.pool.match_prefix(seq.block_hashes[:usable])
            if self.hit_filter is not None:
                hits = self.hit_filter(hits)
            self.pool.touch(hits)
            seq.block_ids = list(hits)
            seq.num_computed_tokens = len(hits) * bs
        self.slide_window(seq)    # a prefix hit or a handed-off prompt may reach past the window
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = min(remaining, budget)
        need = self.blocks_for(seq.num_computed_tokens + n - seq.cache_offset) - len(seq.block_ids)
        if (n < remaining and not self.config.enable_chunked_prefill) or (
                need > self.pool.num_free and not room.make_room(self, seq, need)):
            if not handed_off:   # a handoff keeps its transferred KV while it waits
                self.release(seq)
            return 0
        seq.block_ids.extend(self.pool.allocate(need))
        if seq.num_preemptions == 0:
            self._count_queue_time(time.monotonic() - seq.queued_at)
        if seq.num_preemptions == 0 and not handed_off:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.pool.queries += usable
            self.pool.hits += seq.num_computed_tokens // bs
        return n

    def _count_queue_time(self, seconds: float) -> None:
        self.queue_seconds += seconds
        self.queue_count += 1
        i = bisect_left(QUEUE_TIME_BUCKETS, seconds)     # the first bound >= seconds (Prometheus' `le`)
        if i < len(QUEUE_TIME_BUCKETS):
            self.queue_time_counts[i] += 1

    def queue_time_buckets(self) -> tuple[tuple[float, int], ...]:
        """(upper bound, requests that waited at most that long) per bucket, cumulative as Prometheus
        counts them; the +Inf bucket is `queue_count`."""
        return tuple(zip(QUEUE_TIME_BUCKETS, accumulate(self.queue_time_counts)))

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free `seq`'s blocks and queue it first, to be recomputed."""
        self.running.remove(seq)
        self.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s blocks; what they held is to be recomputed."""
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0
        seq.num_dropped_blocks = 0
        seq.captured, seq.compacted, seq.compaction_offset = [], False, 0   # recomputed: compacted again

    # --- after the forward pass ------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[Sequence, list[int]]) -> None:
        """Advance computed counts, publish newly full blocks, append sampled tokens and apply
        the token-level stop rules (stop strings are the engine's, after detokenization).
        A verification appends its accepted drafts plus one token; its computed count covers
        the pending token and the accepted drafts only (the rejected slots are rolled back)."""
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue
            tokens = sampled.get(seq) or []
            # A verification computed the pending token and the drafts; only the accepted ones count.
            seq.num_computed_tokens += len(tokens) if chunk.draft else chunk.num_tokens
            reason = None
            for token in tokens:
                seq.token_ids.append(token)
                reason = self.stop_reason(seq, token)
                if reason is not None:
                    # Tokens after a stop are dropped: a step-by-step decode would never make them.
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                    break
            self._cache_full_blocks(seq)
            if reason is not None:
                self.finish(seq, reason)
            elif chunk.draft:
                self.trim_blocks(seq)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        if not self.pool.enable_prefix_caching or seq.compacted:   # no key describes compacted KV
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_published_blocks:
            return
        if len(seq.block_hashes) < full:
            seq.block_hashes = hash_prefix_blocks(seq.token_ids[: full * self.block_size], self.block_size,
                                                  seq.sampling.cache_salt, seq.block_hashes)
        for i in range(seq.num_published_blocks, full):
            self.pool.cache_block(seq.live_block(i), seq.block_hashes[i])
        seq.num_published_blocks = full

    def max_len(self, seq: Sequence) -> int:
        """Tokens a sequence may reach: the context, or for a windowed one the positions RoPE has."""
        return self.max_model_len if seq.kv_window is None else max(self.max_model_len, self.max_positions)

    def stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        sp = seq.sampling
        if (not sp.ignore_eos and token in self.eos_token_ids) or token in sp.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_len(seq):
            return FinishReason.LENGTH
        return None
