"""Weighted fair sharing of each engine step between tenants, for the scheduler.

A lone tenant gets the whole step, as without this policy. When sequences of two or more tenants
are runnable (running, or queued for admission), the step's token budget drops to
`fair_step_tokens` (so that a step, which every running sequence waits for, stays about as cheap
as a lone decode's; more only when every tenant has that much more to do per weight, as when all
are prefilling prompts) and each tenant gets at most its weighted share of it: decode rows, prefill
chunk tokens and speculative lookahead alike. Shares are deficit round robin: a tenant's unused
fraction of a token carries to the next step (so 64 tenants sharing 8 tokens each run every 8th
step), and within a tenant the sequence served longest ago goes first, so none starves. A
sequence skipped in a step keeps its blocks and simply waits.

Slots follow the same shares: when the batch is full (`max_num_seqs`) and a tenant below its
weighted share of the slots waits, the youngest sequence (one outside the step first) of the
tenant furthest over its share is preempted for it (its full blocks stay in the prefix cache, so
its recompute is mostly hits). Weights are `SchedulerConfig.tenant_weights` (1 for a tenant not named there).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

from cluster.engine.sequence import Sequence


class FairShare:
    def __init__(self, weights: Mapping[str, float], step_tokens: int):
        self.weights = dict(weights)
        self.step_tokens = step_tokens
        self.deficit: dict[str, float] = {}   # tokens each contending tenant may still use
        self.turn = 0                         # steps planned: a sequence's last turn orders its tenant's round robin
        self.last_turn: dict[Sequence, int] = {}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def start_step(self, demand: Mapping[str, int], budget: int) -> int | None:
        """Open a step among the tenants with runnable sequences (`demand`: the tokens each could
        use now): the contended budget, or None when fewer than two tenants contend (the step is
        the whole budget's, unshared). The contended budget is `step_tokens`, or more where every
        tenant can use more per weight (prompts being prefilled on all sides, as on a prefill
        worker): enough to serve the lightest tenant's whole demand, so that large steps are
        taken only where no tenant's tokens wait on them."""
        self.turn += 1
        present = set(demand)
        if len(present) < 2:
            self.deficit.clear()
            return None
        total = sum(self.weight(t) for t in present)
        lightest = min(demand[t] / self.weight(t) for t in present)
        budget = min(budget, max(self.step_tokens, math.ceil(lightest * total)))
        # A tenant absent this step banks nothing; a present one at most one step's share (or 1 token).
        quanta = {t: budget * self.weight(t) / total for t in present}
        self.deficit = {t: min(self.deficit.get(t, 0.0) + q, max(q, 1.0)) for t, q in quanta.items()}
        return budget

    def allowance(self, tenant: str) -> int:
        """Whole tokens `tenant` may still schedule this step (a contended step only)."""
        return max(0, math.floor(self.deficit.get(tenant, 0.0) + 1e-9))

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """`seq` was given `num_tokens` this step (a chunk, or lookahead past it)."""
        if seq.tenant in self.deficit:
            self.deficit[seq.tenant] -= num_tokens
        self.last_turn[seq] = self.turn

    def pick(self, running: list[Sequence], budget: int) -> dict[Sequence, int]:
        """The running sequences a contended step serves and each one's tokens: per tenant at
        most its allowance, the sequence served longest ago first, within `budget` in all."""
        left = {t: self.allowance(t) for t in self.deficit}
        out: dict[Sequence, int] = {}
        for seq in self.order(running):
            n = min(seq.num_tokens - seq.num_computed_tokens, left.get(seq.tenant, 0), budget)
            if n > 0:
                out[seq] = n
                left[seq.tenant] -= n
                budget -= n
        return out

    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        """`seqs` with, per tenant, the one served longest ago first (ties: their given order)."""
        return sorted(seqs, key=lambda s: self.last_turn.get(s, 0))

    def forget(self, seq: Sequence) -> None:
        self.last_turn.pop(seq, None)

    def admission_order(self, waiting: Iterable[Sequence], running: Iterable[Sequence]) -> list[Sequence]:
        """Queued sequences, those of tenants holding fewest slots per weight first (stable)."""
        held = Counter(s.tenant for s in running)
        return sorted(waiting, key=lambda s: held[s.tenant] / self.weight(s.tenant))

    def slot_to_free(self, seq: Sequence, running: list[Sequence], planned: set[Sequence]) -> Sequence | None:
        """With the batch full: the running sequence to preempt so that queued `seq` gets a slot,
        or None when `seq`'s tenant already holds its weighted share of the slots. The youngest
        of the tenant furthest over its share, one outside this step's plan (`planned`) first."""
        tenants = {s.tenant for s in running} | {seq.tenant}
        total = sum(self.weight(t) for t in tenants)
        held = Counter(s.tenant for s in running)

        def over(t: str) -> float:   # slots held past the tenant's weighted share
            return held[t] - len(running) * self.weight(t) / total
        if over(seq.tenant) + 1 > 0:
            return None
        tenant = max(held, key=over)
        if tenant == seq.tenant or over(tenant) < 1:
            return None
        mine = [s for s in running if s.tenant == tenant]
        unplanned = [s for s in mine if s not in planned]
        return (unplanned or mine)[-1]
