"""A follower rank (1..N-1) of a tensor-parallel worker: it builds what a pass needs (its shard of
the model, its share of the KV pool, its attention backend) the way rank 0's engine does, then
runs every pass rank 0 broadcasts, until a stop message or rank 0's end (its collectives fail).

No scheduler, no sampler, no router: the pass's inputs arrive whole in each step message.
"""
from __future__ import annotations

import logging

import torch

from cluster.config import EngineConfig
from cluster.engine import builder
from cluster.engine.speculation import SpecFootprint
from cluster.kv.paged_cache import PagedKVCache
from cluster.parallel import step_message
from cluster.parallel.expert_balancer import apply_placements, placed_experts
from cluster.parallel.group import RankGroup, join_group
from cluster.parallel.kv_export import gather_blocks, scatter_blocks

log = logging.getLogger(__name__)


class FollowerRank:
    """Rank `config.tp_rank`'s model shard, KV share and backend."""

    def __init__(self, config: EngineConfig, group: RankGroup):
        self.group = group
        self.device = builder.setup_threads(config)
        models = builder.load_models(config, self.device, group)
        self.model = models.model
        self.plan = builder.plan_for(config, models, SpecFootprint(), self.device, group)
        self.backend = builder.attention_backend(config, models, self.device)
        self.kv_cache = PagedKVCache(models.layout, self.plan.num_blocks, self.device)
        self.shards = list(models.shards)
        arena = self.kv_cache.arena
        self.full_shape = (*arena.shape[:4], models.layout.total_kv_heads, arena.shape[5])
        self.steps = 0

    def serve(self) -> None:
        """Runs rank 0's passes until its stop message."""
        while True:
            msg = step_message.receive(self.group)
            if msg.stop:
                return
            arena = self.kv_cache.arena
            if msg.op == "gather":
                gather_blocks(self.group, arena, self.shards, msg.blocks, None)
                continue
            if msg.op == "experts":
                apply_placements(self.group, placed_experts(self.model), msg.placement)
                continue
            if msg.op == "scatter":
                scatter_blocks(self.group, arena, self.shards[self.group.rank], msg.blocks, None, self.full_shape)
                continue
            self.model(msg.input_ids, msg.positions, self.kv_cache.arena, self.backend,
                       self.backend.prepare(msg.batch), msg.logits_indices)
            self.steps += 1


def follower_main(config: EngineConfig, address: str) -> None:
    """A follower process's body (started by `local_ranks.LocalRanks` or a placement group's actor)."""
    logging.basicConfig(level=logging.WARNING)
    group = join_group(config.tp_rank, config.tensor_parallel_size, address, torch.device(config.device),
                       config.tp_collective_timeout_s)
    try:
        FollowerRank(config, group).serve()
    finally:
        group.close()
