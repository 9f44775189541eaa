"""EAGLE proposer: drafts with the head over the target's own last hidden states.

Position n (the pending token x_n) pairs x_n with the true feature f_{n-1} kept by the pass over
the target's tokens (eagle_head.py `EagleFeatures`, the sequence's `spec_state`); each
later draft position pairs the previous draft token with the head's own output g. The head's KV
sits in the target's blocks (the arena's last layer), in the slots the engine reserved for the
lookahead; the verification pass rewrites them with true features, so nothing needs undoing.
"""
from __future__ import annotations

import torch

from cluster.config import SpeculativeConfig
from cluster.engine.runner import BatchLayout
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import Draft
from decode.spec.eagle_head import EagleHead, feature_of
from decode.spec.lookahead import DraftBatch, StopRule
from decode.spec.tree import grow, wants_leaves


class EagleProposer:
    method = "eagle"

    def __init__(self, engine, config: SpeculativeConfig, head: EagleHead, heads=None):
        """`heads`: per-tenant head versions (online adaptation, decode/spec/online/heads.py), or None."""
        self.engine = engine
        self.head = head
        self.heads = heads
        self.config = config
        self._alternatives: list = []   # the last draft's runner-up tokens per sequence (where asked for)

    def propose_tree(self, seqs: list[Sequence], ks: list[int], stop_rules: list[StopRule | None],
                     sizes: list[int], budget: int, min_gain: float) -> list[Draft]:
        """Chains, then the head's runner-up tokens as leaves where they are expected to add most
        (decode/spec/tree.py); the verification pass computes the head's KV and features of the
        tree's rows, and the accepted path's are kept (eagle_head.py `keep`)."""
        drafts = self.propose(seqs, ks, stop_rules, alternatives=wants_leaves(sizes, ks))
        return grow(drafts, self._alternatives, sizes, ks, budget, min_gain)

    def propose(self, seqs: list[Sequence], ks: list[int], stop_rules: list[StopRule | None],
                alternatives: list[bool] | None = None) -> list[Draft]:
        features = [feature_of(s) for s in seqs]
        ready = [i for i, (s, f) in enumerate(zip(seqs, features)) if f is not None
                 and f.pos == s.num_computed_tokens - 1]
        self._alternatives = [[] for _ in seqs]
        if not ready:
            return [Draft(()) for _ in seqs]
        drafting = DraftBatch(seqs, ks, stop_rules, alternatives)
        self._alternatives = drafting.alternatives
        groups: dict[int, tuple[EagleHead, list[int]]] = {}   # one drafting loop per head (tenants' versions)
        for i in ready:
            head = self.head if self.heads is None else self.heads.head_for(seqs[i].tenant)
            groups.setdefault(id(head), (head, []))[1].append(i)
        for head, active in groups.values():
            self._draft(head, active, seqs, ks, [features[i].hidden for i in active], drafting)
        return drafting.drafts()

    def _draft(self, head: EagleHead, active: list[int], seqs: list[Sequence], ks: list[int], feats: list,
               drafting: DraftBatch) -> None:
        eng = self.engine
        bs = eng.layout.block_size
        feats = torch.stack(feats)
        last = [seqs[i].token_ids[-1] for i in active]
        for step in range(max(ks[i] for i in active)):
            layout = BatchLayout(bs, eng.device)
            for i, tok in zip(active, last):
                layout.add([tok], seqs[i].num_tokens - 1 + step, seqs[i].block_ids)
            ids_t, pos_t, batch = layout.tensors()
            g, logits = head(ids_t, feats, pos_t, eng.kv_cache.arena[-1], eng.backend, eng.backend.prepare(batch),
                             torch.arange(len(active), device=eng.device))
            open_rows = drafting.step(active, logits)
            if not open_rows:
                break
            active = [active[j] for j in open_rows]
            feats = g.index_select(0, torch.tensor(open_rows, device=eng.device))
            last = [drafting.tokens[i][-1] for i in active]

    def release(self, seq: Sequence) -> None:
        pass
