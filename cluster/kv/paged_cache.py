"""The paged KV cache tensors and the memory plan that sizes them.

One arena holds every layer: [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]. A single
allocation is what a transport registers once (NIXL) and what a block id indexes everywhere.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.config import CacheConfig, SchedulerConfig
from cluster.model.model_config import ModelConfig
from cluster.types import KVLayout

log = logging.getLogger(__name__)

_MIB = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    headroom_bytes: int
    bytes_per_block: int
    num_blocks: int
    capped: bool   # True when the pool was cut to what the batch limits can ever use

    def describe(self) -> str:
        return (f"memory plan: budget {self.budget_bytes / _MIB:.0f} MiB = weights {self.weight_bytes / _MIB:.0f}"
                f" + activations {self.activation_bytes / _MIB:.0f} + headroom {self.headroom_bytes / _MIB:.0f}"
                f" + KV {self.num_blocks * self.bytes_per_block / _MIB:.0f} MiB"
                f" ({self.num_blocks} blocks of {self.bytes_per_block / 1024:.0f} KiB"
                f"{', capped by max_num_seqs x max_model_len' if self.capped else ''})")


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def resident_bytes(module: torch.nn.Module) -> int:
    """Weights as they sit in memory: parameters and buffers (packed or upcast layouts, tables)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def plan_memory(model_cfg: ModelConfig, layout: KVLayout, cache: CacheConfig, sched: SchedulerConfig,
                dtype: torch.dtype, weight_bytes: int, max_model_len: int, device: torch.device,
                companion_per_block: int = 0, companion_bytes: int = 0) -> MemoryPlan:
    """`companion_per_block`: bytes another cache keeps for every block of this one (a
    speculator's own KV, `SpecFootprint`); `companion_bytes`: memory it needs besides (its weights,
    its own spare blocks).
    Both come out of the same budget, so the pool is sized for everything the engine allocates."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = (4 * model_cfg.hidden_size + model_cfg.q_size + 2 * model_cfg.kv_size
                 + 3 * model_cfg.intermediate_size) * itemsize
    logits = sched.max_num_seqs * model_cfg.vocab_size * 4 * 3   # fp32 logits + sampler copies
    activation = sched.max_num_batched_tokens * per_token + logits
    per_block = layout.bytes_per_block() + companion_per_block
    weight_bytes += companion_bytes
    blocks_per_seq = -(-max_model_len // cache.block_size)
    ceiling = sched.max_num_seqs * blocks_per_seq + 1
    if cache.num_blocks is not None:
        budget = weight_bytes + activation + cache.num_blocks * per_block
        return MemoryPlan(budget, weight_bytes, activation, 0, per_block, cache.num_blocks, False)
    if cache.memory_budget_bytes is not None:
        budget = cache.memory_budget_bytes
        kv_bytes = budget - weight_bytes - activation
    else:
        # Weights are already resident, so a share of what is still available goes to KV.
        budget = int(available_memory(device) * cache.memory_fraction) + weight_bytes
        kv_bytes = budget - weight_bytes - activation
    headroom = int(budget * cache.headroom_fraction)
    kv_bytes -= headroom
    num_blocks = kv_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"memory budget of {budget / _MIB:.0f} MiB leaves no room for the KV cache "
            f"(weights {weight_bytes / _MIB:.0f} MiB, activations {activation / _MIB:.0f} MiB); "
            "raise the budget or lower max_num_batched_tokens")
    capped = num_blocks > ceiling
    return MemoryPlan(budget, weight_bytes, activation, headroom, per_block, min(num_blocks, ceiling), capped)


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        dtype = getattr(torch, layout.dtype)
        # Zeroed, not empty: padded gathers read unused slots and NaN garbage would leak
        # through a zero attention weight (0 * NaN = NaN).
        self.arena = torch.zeros((layout.num_layers, 2, num_blocks, layout.block_size,
                                  layout.num_kv_heads, layout.head_dim), dtype=dtype, device=device)

    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's K and V of block `src` into block `dst` (a forked sample's own copy of the
        prompt's partial last block, which both sequences go on writing)."""
        self.arena[:, :, dst].copy_(self.arena[:, :, src])
