"""QuantSpec's proposer: the target's own checkpoint with 4-bit linears drafts over the target's
own KV cache (no second model to load, no second cache, nothing to catch up on).

The hierarchical KV cache: with `--kv-cache-dtype int8` every value the target stores carries an
int4 view (its top nibble, cluster/kv/kv_quant.py's int4_values), and `--quantspec-kv-view int4`
has the draft attend through it while the target's verification reads all eight bits. The view
reads the same bytes here (a row's nibbles are not stored apart), and it cost a quarter of the
draft's acceptance (0.99 -> 0.74, docs/quantization.md), so by default (`full`) the draft reads the
cache as the target does, whatever its dtype. The view is the C kernels' and the torch
reference's, not the Triton kernels'.

Why sharing is safe: a draft pass writes K/V only at the positions the following verification
writes again (the pending token's and the drafts fed back, all inside the blocks the scheduler
reserved for the lookahead, none shared with another sequence or the prefix cache: those hold
computed tokens only). The target overwrites them with its own K/V before any of its queries reads
them, and rejected positions are past the sequence's length, rewritten before they are read.
"""
from __future__ import annotations

import logging

import torch

from cluster.config import SpeculativeConfig
from cluster.engine.runner import ModelRunner
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import Draft
from cluster.kv.kv_quant import KVCacheDType
from cluster.model.attention import make_attention_backend
from cluster.model.model_config import ModelConfig
from decode.spec.draft_model import DraftPasses
from decode.spec.lookahead import StopRule
from decode.spec.tree import grow, wants_leaves

log = logging.getLogger(__name__)


class QuantSpecProposer:
    method = "quantspec"

    def __init__(self, engine, config: SpeculativeConfig, model_config: ModelConfig, model: torch.nn.Module):
        self.engine, self.config = engine, config
        self.model_config, self.model = model_config, model      # 4-bit linears (loading.py)
        mc = model_config
        kind = KVCacheDType(engine.config.cache.kv_cache_dtype)
        self.int4_view = config.quantspec_kv_view == "int4"
        if self.int4_view and kind is not KVCacheDType.INT8:
            raise ValueError(f"--quantspec-kv-view int4 reads an int8 KV cache through its int4 view: it needs "
                             f"--kv-cache-dtype int8 (this engine's is {kind.value})")
        backend = make_attention_backend(engine.config.attention_backend, mc.num_heads, mc.num_kv_heads,
                                         mc.head_dim, engine.device, engine.kernel_plan, engine.dtype,
                                         scale=mc.attention_scale, int4_view=self.int4_view)
        log.info("quantspec: 4-bit draft over the target's %s KV cache%s", kind.value,
                 " through its int4 view" if self.int4_view else "")
        arena = engine.kv_cache.arena
        runner = ModelRunner(model, arena, backend, engine.layout.block_size, engine.device)
        graphs = None
        if engine.graph_replay is not None and backend.static_decode_ready():
            # Pad rows write to the block past the pool's, as the engine's own graphs do.
            graphs = engine.decode_graphs(model, arena, backend, engine.memory_plan.num_blocks)
        self.passes = DraftPasses(runner, graphs)

    def propose(self, seqs: list[Sequence], ks: list[int], stop_rules: list[StopRule | None]) -> list[Draft]:
        # The first pass feeds each sequence's tokens past its computed KV (the pending token), at
        # their positions in the sequence's own blocks, which the scheduler reserved up to
        # num_tokens + k - 1 (scheduler.lookahead_room).
        spans = [(seq.token_ids[seq.num_computed_tokens:], seq.num_computed_tokens, seq.block_ids) for seq in seqs]
        return self.passes.draft(seqs, ks, stop_rules, spans)

    def propose_tree(self, seqs: list[Sequence], ks: list[int], stop_rules: list[StopRule | None],
                     sizes: list[int], budget: int, min_gain: float) -> list[Draft]:
        """Chains of up to ks[i] tokens, then runner-up leaves up to sizes[i] tokens in all,
        `budget` leaves in all (decode/spec/tree.py). Leaves need no K/V of the draft's: it never
        runs past them, and the target's K/V of the accepted path lands at its own slots
        (draft_tree.compaction)."""
        spans = [(seq.token_ids[seq.num_computed_tokens:], seq.num_computed_tokens, seq.block_ids) for seq in seqs]
        drafts = self.passes.draft(seqs, ks, stop_rules, spans, alternatives=wants_leaves(sizes, ks))
        return grow(drafts, self.passes.alternatives, sizes, ks, budget, min_gain)

    def release(self, seq: Sequence) -> None:
        pass    # no state of its own: the target's blocks are the target's
