"""EAGLE proposer: drafts with the head over the target's own last hidden states.

Position n (the pending token x_n) pairs x_n with the true feature f_{n-1} the engine kept; each
later draft position pairs the previous draft token with the head's own output g. The head's KV
sits in the target's blocks (the arena's last layer), in the slots the engine reserved for the
lookahead; the verification pass rewrites them with true features, so nothing needs undoing.
"""
from __future__ import annotations

import torch

from cluster.config import SpeculativeConfig
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import Draft
from cluster.model.attention import AttentionBatch
from decode.spec.lookahead import StopRule, draw_draft_token, keep_drafting


class EagleProposer:
    method = "eagle"

    def __init__(self, engine, config: SpeculativeConfig):
        if engine.eagle is None:
            raise ValueError("the EAGLE proposer needs an engine built with speculative method 'eagle'")
        self.engine = engine
        self.head = engine.eagle
        self.config = config

    def propose(self, seqs: list[Sequence], ks: list[int], stop_rules: list[StopRule | None]) -> list[Draft]:
        eng = self.engine
        bs = eng.layout.block_size
        ready = [i for i, s in enumerate(seqs) if s.spec_feature is not None
                 and s.spec_feature_pos == s.num_computed_tokens - 1]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        if not ready:
            return [Draft(()) for _ in seqs]
        active = ready
        confidence: list[list[float]] = [[] for _ in seqs]
        feats = torch.stack([seqs[i].spec_feature for i in active])
        last = [seqs[i].token_ids[-1] for i in active]
        for step in range(max(ks[i] for i in active)):
            pos = [seqs[i].num_tokens - 1 + step for i in active]
            slots = [seqs[i].block_ids[p // bs] * bs + p % bs for i, p in zip(active, pos)]
            batch = AttentionBatch(num_decode=len(active), decode_context_lens=tuple(p + 1 for p in pos),
                                   decode_block_tables=tuple(tuple(seqs[i].block_ids) for i in active),
                                   prefills=(), slot_mapping=torch.tensor(slots, device=eng.device), block_size=bs)
            g, logits = self.head(torch.tensor(last, device=eng.device), feats, torch.tensor(pos, device=eng.device),
                                  eng.kv_cache.arena[-1], eng.backend, eng.backend.prepare(batch),
                                  torch.arange(len(active), device=eng.device))
            keep, next_tokens = [], []
            open_ = [False] * len(seqs)
            for j, i in enumerate(active):
                tok, p, top = draw_draft_token(logits[j], seqs[i], stop_rules[i] is not None)
                tokens[i].append(tok)
                if p is not None:
                    probs[i].append(p)
                confidence[i].append(top)
                if len(tokens[i]) < ks[i]:
                    keep.append(j)
                    next_tokens.append(tok)
                    open_[i] = True
            # A draft step costs the same for one sequence or the whole batch: it runs while the
            # batch's expected gain pays for it, and every open sequence rides along.
            if not keep or not keep_drafting(stop_rules, confidence, open_):
                break
            active = [active[j] for j in keep]
            feats = g.index_select(0, torch.tensor(keep, device=eng.device))
            last = next_tokens
        return [Draft(tuple(t), torch.stack(p) if p else None, tuple(c)) for t, p, c in zip(tokens, probs, confidence)]

    def release(self, seq: Sequence) -> None:
        pass
