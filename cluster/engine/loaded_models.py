"""`Models`, what `builder.load_models` loads: the target on its kernel plan, and its KV layout.

Below both `builder.py`, which loads it, and `speculation.py`, whose `Speculator.load` reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.model.kernel_plan import KernelPlan
from cluster.model.model_config import ModelConfig
from cluster.types import KVLayout


@dataclass
class Models:
    """What `load_models` loads: the target (a speculator's `load` reads it)."""
    config: ModelConfig
    model: torch.nn.Module
    dtype: torch.dtype
    kernel_plan: KernelPlan
    max_model_len: int
    layout: KVLayout
    # Tensor parallel: every rank's share (cluster/parallel/sharding.py RankShard), in rank order.
    shards: tuple = ()
    # Positions the RoPE table holds: max_model_len, or more for windowed sequences (--kv-window).
    max_positions: int = 0
