"""The engine's side of speculative decoding: the one interface it calls, and what a draft is.

The engine owns the mechanics: it asks the speculator how many tokens each running decode should
propose (`lookahead`), reserves KV blocks for them (never preempting anyone for a guess), asks
for the drafts (`propose`), verifies k+1 positions of every drafted sequence in the same forward
pass as the rest of the batch, and hands each sequence's k+1 rows of logits back (`verify`),
which returns the tokens to append: the accepted prefix plus one token of the target's own.
Rejected positions roll back in the scheduler (their KV slots are overwritten later and blocks
reserved past the kept tokens go back to the pool).

Everything else lives with the decode role (`decode/spec/`): what loads beside the target and
what it adds to the KV layout and the memory plan (`load`, a `SpecFootprint`), a pass over the
target's hidden states after each forward (`after_forward`, `after_update`), per-block state that
filters prefix hits (`usable_hits`, `invalidate`), the proposer state that crosses a P/D handoff
beside the blocks (`export_state`, `import_state`), proposers, acceptance rules and dynamic
lookahead. A prefill worker runs one that never proposes but still computes what a handed-off
request needs to speculate at once.

The engine's step sees the speculator as a `SpecStep`; the builder wires its `HiddenStatePass`,
the handoffs read its `HandoffState`. An engine built without one gets `NoSpeculation`.

`attach_drafts` and `choose_tokens` are the engine's two moments of a speculative step: before
the pass (drafts become verifications) and after it (rows become tokens).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.config import EngineConfig
from cluster.engine import draft_tree
from cluster.engine.loaded_models import Models
from cluster.engine.sampler import logprob_entry, sample
from cluster.engine.scheduler import Scheduler, StepPlan
from cluster.engine.sequence import Sequence
from cluster.types import SamplingParams

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None   # [k, V] what each token was drawn from; None: a deterministic guess
    confidences: tuple[float, ...] = ()  # the proposer's top probability per token (dynamic lookahead)
    parents: tuple[int, ...] = ()        # a token tree (draft_tree.py): each token's parent, -1 the root; () a chain

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class SpecFootprint:
    """What speculation adds to the target, known once its models are loaded (builder.py plans with it)."""
    extra_kv_layers: int = 0     # layers of its own at the end of the target's arena (same blocks and slots)
    model_id_suffix: str = ""    # appended to the layout's model id: a P/D peer's blocks must carry those layers too
    bytes_per_block: int = 0     # memory kept beside every target block (another cache's KV)
    extra_bytes: int = 0         # memory besides (its weights, its spare blocks)
    # It runs over the target's hidden states after every pass (`after_forward`; decode graphs
    # off) and keeps state per block (prefix hits go through `usable_hits`, allocations reset it).
    hidden_states: bool = False
    hidden_layers: tuple[int, ...] = ()   # whose outputs it reads, side by side (): the last layer's
    max_draft_tokens: int = 0    # the widest draft a verification checks (0: it never proposes)


class SpecStep(Protocol):
    """What a step calls: sizes, drafts, verification, and the update's end (`attach_drafts`,
    `choose_tokens`, `LLMEngine._update`)."""

    def lookaheads(self, plan: StepPlan) -> list[int]:
        """Tokens to propose for each of `plan.decodes` this step (0: a plain decode)."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Drafts of at most ks[i] tokens, each continuing seqs[i].token_ids."""

    def verify(self, seq: Sequence, logits: torch.Tensor, draft: Draft) -> list[int]:
        """logits [len(draft)+1, V] at the last token and after each draft token: the tokens to append."""

    def after_update(self, forks: dict[Sequence, list[Sequence]]) -> None:
        """After the scheduler's update: computed counts are final; `forks` spawned from their parents."""

    def release(self, seq: Sequence) -> None:
        """Forget a request's proposer state (it finished, was aborted or preempted)."""


class HiddenStatePass(Protocol):
    """A pass over the target's hidden states with state per block: wired into the runner, the
    pool and the scheduler at construction when the footprint says `hidden_states`."""

    def after_forward(self, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor,
                      hidden: torch.Tensor, meta) -> None:
        """The target's pre-norm hidden states of the step's tokens."""

    def usable_hits(self, hits: list[int]) -> list[int]:
        """The longest prefix of a prefix-cache hit this engine can continue from."""

    def invalidate(self, blocks: list[int]) -> None:
        """`blocks` were just allocated: what was kept for them is gone."""


class HandoffState(Protocol):
    """The proposer state that crosses a P/D handoff beside the blocks (prefill/ and decode/handoff.py)."""

    def export_state(self, seq: Sequence) -> bytes:
        """What a decode worker needs beside `seq`'s blocks to speculate at once (b"": nothing)."""

    def import_state(self, data: bytes, num_prompt_tokens: int) -> object:
        """The `Sequence.spec_state` a handed-off sequence starts with; ValueError if `data` cannot be it."""


class Speculator(SpecStep, HiddenStatePass, HandoffState, Protocol):
    """What an engine's speculator is: built with the engine (`load`, then `attach`), asked about
    each request (`check_request`), and the three narrow parts above, each given only to what calls it."""
    heads: object | None    # --spec-online's head versions (decode/spec/online/heads.py), or None

    def load(self, target: Models, device: torch.device) -> SpecFootprint:
        """Load what runs beside the target (before the memory plan) and say what it adds."""

    def attach(self, engine) -> None:
        """The engine is built (cache, pool, backend): make what runs over them."""

    def check_request(self, sampling: SamplingParams) -> None:
        """Raise ValueError when this speculator cannot serve what `sampling` asks for."""

    def stats(self) -> dict:
        """Counters by method: drafted, accepted, verify steps."""


class NoSpeculation:
    """The speculator of an engine built without one: it loads nothing, never proposes, and
    refuses requests that ask for a speculative method (so the engine needs no None checks)."""

    heads = None    # no online adaptation

    def __init__(self, config: EngineConfig):
        self.config = config

    def load(self, target: Models, device: torch.device) -> SpecFootprint:
        if self.config.speculative.method != "off":
            log.warning("speculative method %r is configured but this engine has no speculator: it runs without",
                        self.config.speculative.method)
        return SpecFootprint()

    def attach(self, engine) -> None:
        pass

    def check_request(self, sampling: SamplingParams) -> None:
        if sampling.speculative not in (None, "off"):
            raise ValueError(f"speculative={sampling.speculative!r} was asked for, but this engine runs without "
                             "speculative decoding; start it with --speculative")

    def lookaheads(self, plan: StepPlan) -> list[int]:
        return [0] * len(plan.decodes)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(()) for _ in seqs]

    def verify(self, seq: Sequence, logits: torch.Tensor, draft: Draft) -> list[int]:
        raise AssertionError("an engine without a speculator verifies no draft")

    def after_update(self, forks: dict[Sequence, list[Sequence]]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def after_forward(self, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor,
                      hidden: torch.Tensor, meta) -> None:
        pass

    def usable_hits(self, hits: list[int]) -> list[int]:
        return hits

    def invalidate(self, blocks: list[int]) -> None:
        pass

    def export_state(self, seq: Sequence) -> bytes:
        return b""

    def import_state(self, data: bytes, num_prompt_tokens: int) -> object:
        return None

    def stats(self) -> dict:
        return {}


# What an engine is given to speculate: `LLMEngine(config, speculator_factory=...)` calls it with its config.
SpeculatorFactory = Callable[[EngineConfig], Speculator]


def attach_drafts(speculator: SpecStep, scheduler: Scheduler, plan: StepPlan) -> dict[Sequence, Draft]:
    """Turn the plan's decodes that get a draft into verifications; returns the drafts by sequence."""
    chunks, ks = [], []
    for chunk, k in zip(list(plan.decodes), speculator.lookaheads(plan)):
        if k > 0:
            k = scheduler.lookahead_room(chunk.seq, k, plan)
        if k > 0:
            chunks.append(chunk)
            ks.append(k)
    out: dict[Sequence, Draft] = {}
    if not chunks:
        return out
    for chunk, draft in zip(chunks, speculator.propose([c.seq for c in chunks], ks)):
        if draft.parents:
            draft_tree.check(draft.tokens, draft.parents)
        if draft.tokens:
            scheduler.attach_draft(plan, chunk, draft.tokens, draft.parents)
            out[chunk.seq] = draft
        else:
            scheduler.trim_blocks(chunk.seq)
    return out


def choose_tokens(logits: torch.Tensor, seqs: list[Sequence], drafts: dict[Sequence, Draft],
                  speculator: SpecStep) -> tuple[dict[Sequence, list[int]], dict[Sequence, int]]:
    """Plain rows are sampled together; each verification's k+1 rows go to the speculator. A
    prompt's forks draw from its row beside it. Returns (tokens per sequence, first token per fork)."""
    forked: dict[Sequence, int] = {}
    if not drafts and not any(seq.forks for seq in seqs):
        return {seq: [t] for seq, t in zip(seqs, sample(logits, seqs))}, forked
    out: dict[Sequence, list[int]] = {}
    plain_rows, plain_seqs, forks, row = [], [], set(), 0
    for seq in seqs:
        draft = drafts.get(seq)
        if draft is None:
            plain_rows.append(row)
            plain_seqs.append(seq)
            for fork in seq.forks:
                plain_rows.append(row)
                plain_seqs.append(fork)
                forks.add(fork)
            row += 1
            continue
        rows = logits[row:row + len(draft) + 1]
        out[seq] = _verify(speculator, seq, rows, draft)
        row += len(draft) + 1
    if plain_seqs:
        index = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
        for seq, t in zip(plain_seqs, sample(logits.index_select(0, index), plain_seqs)):
            if seq in forks:
                forked[seq] = t
            else:
                out[seq] = [t]
    return out, forked


def _verify(speculator: SpecStep, seq: Sequence, rows: torch.Tensor, draft: Draft) -> list[int]:
    tokens = speculator.verify(seq, rows, draft)
    if seq.sampling.logprobs is not None:
        # A tree's tokens come from the rows of the accepted path: the root's, then each accepted node's.
        path = [0, *(n + 1 for n in draft_tree.accepted_nodes(draft.tokens, draft.parents, tokens[:-1]))] \
            if draft.parents else range(len(tokens))
        for i, tok in zip(path, tokens):
            seq.logprobs.append(logprob_entry(torch.log_softmax(rows[i], dim=-1), tok, seq.sampling.logprobs))
    return tokens


def compact_trees(arena: torch.Tensor, drafts: dict[Sequence, Draft], tokens: dict[Sequence, list[int]],
                  block_size: int) -> None:
    """Before the scheduler's update: each token tree's accepted path moves from the slots its
    nodes were written to down to the slots of its positions (cluster/engine/draft_tree.py), in
    every layer of `arena`, so the kept K/V is what plain decoding would have written there."""
    moves = []
    for seq, draft in drafts.items():
        if not draft.parents:
            continue
        nodes = draft_tree.accepted_nodes(draft.tokens, draft.parents, tokens[seq][:-1])
        blocks = seq.block_ids
        for src, dst in draft_tree.compaction(seq.num_tokens - 1, nodes):
            moves.append((blocks[src // block_size] * block_size + src % block_size,
                          blocks[dst // block_size] * block_size + dst % block_size))
    draft_tree.move_slots(arena, moves)
