"""What a draft model takes beside the target, planned with it so the draft is inside the budget.

The draft keeps one KV block for every target block (its own arena: its shape differs) plus
lookahead room for every sequence (draft_model.py sizes its pool the same way), and its weights as
laid out for the kernel plan. An EAGLE head needs no plan of its own here: its KV is one more
layer of the target's arena, so the layout's bytes per block already count it.
"""
from __future__ import annotations

import torch

from cluster.config import EngineConfig
from cluster.kv.paged_cache import resident_bytes
from cluster.model.model_config import ModelConfig
from cluster.types import KVLayout


def draft_layout(draft_config: ModelConfig, block_size: int, dtype: str) -> KVLayout:
    return KVLayout(model_id=draft_config.model_id, num_layers=draft_config.num_kv_layers,
                    num_kv_heads=draft_config.num_kv_heads, head_dim=draft_config.head_dim, block_size=block_size,
                    dtype=dtype)


def lookahead_blocks(config: EngineConfig) -> int:
    """Blocks beyond the target's pool: room for every sequence's widest draft."""
    bs = config.cache.block_size
    return config.scheduler.max_num_seqs * -(-(config.speculative.max_speculative_tokens + 1) // bs)


def draft_footprint(draft_model: torch.nn.Module, draft_config: ModelConfig, config: EngineConfig,
                    dtype: str) -> tuple[int, int]:
    """Bytes per draft KV block (one for every target block), and the draft's weights plus its
    lookahead blocks."""
    per_block = draft_layout(draft_config, config.cache.block_size, dtype).bytes_per_block()
    return per_block, resident_bytes(draft_model) + lookahead_blocks(config) * per_block
