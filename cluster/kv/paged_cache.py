"""The paged KV cache tensors and the memory plan that sizes them.

One arena holds every layer: [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]. A single
allocation is what a transport registers once (NIXL) and what a block id indexes everywhere.
"""
from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch

from cluster.config import CPU_KV_CACHE_DEFAULT_BYTES, CacheConfig, SchedulerConfig, format_size
from cluster.kv.kv_quant import KVCacheDType, row_width
from cluster.model.model_config import ModelConfig
from cluster.types import KVLayout

log = logging.getLogger(__name__)

_MIB = 1 << 20

# What can set the pool's size, each named by the flag that raises it (the plan's `limit`).
FIXED = "--num-kv-blocks"
BUDGET = "--memory-budget-bytes"
KV_CACHE_MEMORY = "--kv-cache-memory"
BATCH_LIMITS = "--max-num-seqs x --max-model-len (all the batch can ever hold)"


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    headroom_bytes: int
    bytes_per_block: int
    num_blocks: int
    limit: str     # what set num_blocks, as the flag that raises it: said in the log and the serve banner

    @property
    def kv_bytes(self) -> int:
        """The KV pool's bytes (a speculator's KV per block included)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def capped(self) -> bool:
        """The pool was cut to what the batch limits can ever use."""
        return self.limit == BATCH_LIMITS

    def describe(self) -> str:
        room = self.budget_bytes - self.weight_bytes - self.activation_bytes - self.headroom_bytes
        return (f"memory plan: KV {format_size(self.kv_bytes)} = {self.num_blocks} blocks of "
                f"{self.bytes_per_block / 1024:.0f} KiB, set by {self.limit}; budget {self.budget_bytes / _MIB:.0f} MiB"
                f" = weights {self.weight_bytes / _MIB:.0f} + activations {self.activation_bytes / _MIB:.0f}"
                f" + headroom {self.headroom_bytes / _MIB:.0f} + room for KV {room / _MIB:.0f} MiB")


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
        return MemoryPlan(budget, weight_bytes, activation, 0, per_block, cache.num_blocks, FIXED)
    budget, budget_limit = _budget(cache, device, weight_bytes)
    headroom = int(budget * cache.headroom_fraction)
    room = budget - weight_bytes - activation - headroom      # what the budget leaves for KV
    if room < per_block:
        raise ValueError(
            f"memory budget of {budget / _MIB:.0f} MiB ({budget_limit}) leaves no room for the KV cache "
            f"(weights {weight_bytes / _MIB:.0f} MiB, activations {activation / _MIB:.0f} MiB); "
            "raise it or lower --max-num-batched-tokens")
    num_blocks, limit = _smallest_limit(room // per_block, budget_limit, kv_cache_cap(cache, device), per_block,
                                        ceiling)
    return MemoryPlan(budget, weight_bytes, activation, headroom, per_block, num_blocks, limit)


def _smallest_limit(budget_blocks: int, budget_limit: str, cap: tuple[int, str] | None, per_block: int,
                    ceiling: int) -> tuple[int, str]:
    """The blocks the smallest limit allows, and its name: the budget's room, the KV cap (if any),
    the batch limits' ceiling. On a tie the first named wins."""
    limits = [(budget_blocks, budget_limit)]
    if cap is not None:
        cap_bytes, cap_limit = cap
        if cap_bytes < per_block:
            raise ValueError(f"{cap_limit} is smaller than one KV block ({format_size(per_block)}); raise it")
        if cap_bytes // per_block > budget_blocks:    # a small node: the share of free memory undercuts the cap
            limits[0] = (budget_blocks, f"{budget_limit}, less than {cap_limit}")
        limits.append((cap_bytes // per_block, cap_limit))
    limits.append((ceiling, BATCH_LIMITS))
    return min(limits, key=lambda pair: pair[0])


def _budget(cache: CacheConfig, device: torch.device, weight_bytes: int) -> tuple[int, str]:
    """The engine's budget (weights, activations, headroom and KV) and the flag that sets it."""
    if cache.memory_budget_bytes is not None:
        return cache.memory_budget_bytes, BUDGET
    # Weights are already resident, so a share of what is still available goes to the rest.
    where = "the GPU's free memory" if device.type == "cuda" else "the memory free at start"
    return (int(available_memory(device) * cache.memory_fraction) + weight_bytes,
            f"--memory-fraction ({cache.memory_fraction:g} of {where})")


def kv_cache_cap(cache: CacheConfig, device: torch.device) -> tuple[int, str] | None:
    """The KV pool's own limit in bytes, and how it is named: `--kv-cache-memory` when given; else
    on CPU a fixed default (a share of a shared host's free memory is GBs per worker for nothing),
    unless an explicit `--memory-budget-bytes` sizes the engine; on CUDA none (the GPU is the
    engine's own)."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes, f"{KV_CACHE_MEMORY} ({format_size(cache.kv_cache_memory_bytes)})"
    if device.type == "cuda" or cache.memory_budget_bytes is not None:
        return None
    return (CPU_KV_CACHE_DEFAULT_BYTES,
            f"{KV_CACHE_MEMORY} (default {format_size(CPU_KV_CACHE_DEFAULT_BYTES)} on CPU)")


def zeroed_on_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the kernel zeroes when first touched (anonymous memory):
    `torch.zeros` writes every byte at once, and two workers' default 4 GiB pools took 6.5 of a
    13 s start on 2 vCPUs (docs/first_run.md). The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        kind = KVCacheDType(layout.kv_dtype)
        dtype = kind.arena_dtype if kind.quantized else getattr(torch, layout.dtype)
        # Zeroed, not empty: padded gathers read unused slots and NaN garbage would leak
        # through a zero attention weight (0 * NaN = NaN).
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads,
                 row_width(layout.head_dim, kind))
        self.arena = zeroed_on_touch(shape, dtype) if device.type == "cpu" else \
            torch.zeros(shape, dtype=dtype, device=device)

    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's K and V of block `src` into block `dst` (a forked sample's own copy of the
        prompt's partial last block, which both sequences go on writing)."""
        self.arena[:, :, dst].copy_(self.arena[:, :, src])
