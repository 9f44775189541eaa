"""Draft-model proposer: a small model of the same tokenizer drafts k tokens autoregressively.

The draft keeps its own paged KV (its own arena and pool; its shape differs from the target's).
Its state for a request is only "how many leading tokens are in my KV": after a verification the
engine keeps the accepted tokens, so the draft's valid KV is the prefix it shares with the
target's computed tokens, and stale slots past it are simply overwritten (the rollback). A
request handed off by a prefill worker starts with no draft KV: the first propose computes the
draft over the prompt (rebuilt on the decode worker; see docs/spec.md for why and its cost).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.config import SpeculativeConfig
from cluster.engine.runner import ModelRunner
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import Draft
from cluster.kv.block_pool import BlockPool
from cluster.kv.paged_cache import PagedKVCache
from cluster.model.attention import make_attention_backend
from cluster.model.model_config import ModelConfig
from decode.spec.lookahead import DraftBatch, StopRule
from decode.spec.memory import draft_layout, lookahead_blocks


@dataclass
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0        # leading tokens of the request whose KV the draft holds


class DraftPasses:
    """The autoregressive drafting loop over a runner (and its decode graphs) that proposers share:
    one pass over each sequence's first span, then one token per sequence per pass, rows
    stopping by their own length or the dynamic stop rule."""

    def __init__(self, runner: ModelRunner, graphs):
        self.runner, self.graphs = runner, graphs
        self.alternatives: list = []    # the last draft's runner-up tokens per sequence (where asked for)

    def draft(self, seqs: list[Sequence], ks: list[int], stop_rules: list[StopRule | None],
              spans: list[tuple[list[int], int, list[int]]], on_pass=None,
              alternatives: list[bool] | None = None) -> list[Draft]:
        """spans[i]: (tokens, first position, block ids) of the first pass; `on_pass(active, spans)`
        is told what each pass wrote; `alternatives[i]`: keep sequence i's runner-up tokens."""
        batch = DraftBatch(seqs, ks, stop_rules, alternatives)
        self.alternatives = batch.alternatives
        blocks = [span[2] for span in spans]
        active = list(range(len(seqs)))
        for _ in range(max(ks)):
            logits = self._run(spans)
            if on_pass is not None:
                on_pass(active, spans)
            open_rows = batch.step(active, logits)
            if not open_rows:
                break
            active = [active[j] for j in open_rows]
            spans = [([batch.tokens[i][-1]], seqs[i].num_tokens + len(batch.tokens[i]) - 1, blocks[i]) for i in active]
        return batch.drafts()

    def _run(self, spans) -> torch.Tensor:
        bucket = None
        if self.graphs is not None and all(len(tokens) == 1 for tokens, _, _ in spans):
            bucket = self.graphs.fits(len(spans))
        if bucket is None:
            return self.runner.run_spans(spans)
        return self.graphs.run_rows([(tokens[0], start, blocks) for tokens, start, blocks in spans], bucket)


class DraftModelProposer:
    method = "draft"

    def __init__(self, engine, config: SpeculativeConfig, model_config: ModelConfig, model: torch.nn.Module):
        self.engine = engine
        self.config = config
        # Loaded with the target, before its memory plan, on the target's kernel plan (loading.py).
        self.model_config, self.model = model_config, model
        mc = self.model_config
        bs = engine.layout.block_size
        self.block_size = bs
        self.layout = draft_layout(mc, bs, engine.layout.dtype)
        # As many blocks as the target's pool plus room for every sequence's lookahead: the draft
        # never runs out before the target does (memory.py planned them).
        num_blocks = engine.pool.num_blocks + lookahead_blocks(engine.config)
        backend = make_attention_backend(engine.config.attention_backend, mc.num_heads, mc.num_kv_heads,
                                         mc.head_dim, engine.device, engine.kernel_plan, engine.dtype,
                                         scale=mc.attention_scale)
        graphed = engine.graph_replay is not None and backend.static_decode_ready()
        # With decode graphs, one more block than the pool's: their pad rows write there.
        self.cache = PagedKVCache(self.layout, num_blocks + (1 if graphed else 0), engine.device)
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        runner = ModelRunner(self.model, self.cache.arena, backend, bs, engine.device)
        # The k - 1 passes after the catch-up are one token per sequence: replayed from graphs.
        graphs = engine.decode_graphs(self.model, self.cache.arena, backend, num_blocks) if graphed else None
        self.passes = DraftPasses(runner, graphs)
        self._states: dict[Sequence, _DraftState] = {}

    def _reserve(self, state: _DraftState, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size) - len(state.block_ids)
        if need > 0:
            state.block_ids.extend(self.pool.allocate(need))

    def propose(self, seqs: list[Sequence], ks: list[int], stop_rules: list[StopRule | None]) -> list[Draft]:
        spans, states = [], []
        for seq, k in zip(seqs, ks):
            state = self._states.setdefault(seq, _DraftState())
            state.computed = min(state.computed, seq.num_computed_tokens)
            # Slots written: the catch-up tokens and k - 1 drafts fed back (the k-th is never fed).
            self._reserve(state, seq.num_tokens + k - 1)
            spans.append((seq.token_ids[state.computed:], state.computed, state.block_ids))
            states.append(state)

        def advance(active, pass_spans):
            for j, i in enumerate(active):
                states[i].computed += len(pass_spans[j][0])
        return self.passes.draft(seqs, ks, stop_rules, spans, advance)

    def release(self, seq: Sequence) -> None:
        state = self._states.pop(seq, None)
        if state is not None:
            self.pool.free(reversed(state.block_ids))
