"""How big the KV pool is planned (cluster/kv/paged_cache.py `plan_memory`), and the sizes
`--kv-cache-memory` takes (cluster/config.py `parse_memory_size`). On CPU the pool defaults to
4 GiB per engine (a share of a shared host's free memory was ~9 GB per worker of a 135M model),
kept within the share of free memory; on CUDA the share of free GPU memory stays the default.
Every plan names the limit that set it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cluster.config import CPU_KV_CACHE_DEFAULT_BYTES, CacheConfig, ConfigError, SchedulerConfig, format_size, \
    parse_memory_size
from cluster.kv import paged_cache
from cluster.kv.paged_cache import BATCH_LIMITS, plan_memory
from cluster.types import KVLayout

GIB = 1 << 30
# SmolLM2-135M's shapes (the default model): 30 layers, 3 KV heads of 64, bf16 -> 360 KiB per block.
MODEL = SimpleNamespace(hidden_size=576, q_size=576, kv_size=192, intermediate_size=1536, vocab_size=49152)
LAYOUT = KVLayout(model_id="smollm2", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
PER_BLOCK = LAYOUT.bytes_per_block()
WEIGHTS = 270 << 20
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _plan(free: int, device=CPU, sched: SchedulerConfig | None = None, max_model_len: int = 8192,
          monkeypatch=None, **cache):
    monkeypatch.setattr(paged_cache, "available_memory", lambda d: free)
    return plan_memory(MODEL, LAYOUT, CacheConfig(**cache), sched or SchedulerConfig(), torch.bfloat16, WEIGHTS,
                       max_model_len, device)


def _room_blocks(plan) -> int:
    """The blocks the budget alone leaves room for (what the pool was before the KV cap)."""
    room = plan.budget_bytes - plan.weight_bytes - plan.activation_bytes - plan.headroom_bytes
    return room // PER_BLOCK


def test_the_cpu_default_caps_the_pool_at_4_gib(monkeypatch):
    plan = _plan(20 * GIB, monkeypatch=monkeypatch)      # 0.4 of 20 GiB would leave ~7.5 GiB for KV
    assert plan.num_blocks == CPU_KV_CACHE_DEFAULT_BYTES // PER_BLOCK == 11650
    assert CPU_KV_CACHE_DEFAULT_BYTES - PER_BLOCK < plan.kv_bytes <= CPU_KV_CACHE_DEFAULT_BYTES
    assert _room_blocks(plan) > plan.num_blocks
    assert plan.limit == "--kv-cache-memory (default 4 GiB on CPU)"
    assert "KV 4 GiB = 11650 blocks of 360 KiB, set by --kv-cache-memory (default 4 GiB on CPU)" in plan.describe()


def test_an_explicit_kv_cache_memory_raises_the_pool(monkeypatch):
    plan = _plan(20 * GIB, monkeypatch=monkeypatch, kv_cache_memory_bytes=6 * GIB)
    assert plan.num_blocks == 6 * GIB // PER_BLOCK and plan.limit == "--kv-cache-memory (6 GiB)"


def test_the_share_of_free_memory_still_bounds_the_pool_and_says_so(monkeypatch):
    """A small node: 0.4 of 4 GiB free leaves less than the default 4 GiB; an explicit larger
    --kv-cache-memory does not lift the share either (--memory-fraction does)."""
    plan = _plan(4 * GIB, monkeypatch=monkeypatch)
    assert plan.num_blocks == _room_blocks(plan) < CPU_KV_CACHE_DEFAULT_BYTES // PER_BLOCK
    assert plan.limit == ("--memory-fraction (0.4 of the memory free at start), less than --kv-cache-memory "
                          "(default 4 GiB on CPU)")
    plan = _plan(20 * GIB, monkeypatch=monkeypatch, kv_cache_memory_bytes=16 * GIB)
    assert plan.num_blocks == _room_blocks(plan) < 16 * GIB // PER_BLOCK
    assert plan.limit.endswith("less than --kv-cache-memory (16 GiB)")
    raised = _plan(20 * GIB, monkeypatch=monkeypatch, kv_cache_memory_bytes=16 * GIB, memory_fraction=0.9)
    assert raised.num_blocks > plan.num_blocks


def test_num_kv_blocks_still_fixes_the_pool(monkeypatch):
    plan = _plan(20 * GIB, monkeypatch=monkeypatch, num_blocks=100, kv_cache_memory_bytes=1 << 20)
    assert (plan.num_blocks, plan.limit, plan.headroom_bytes) == (100, "--num-kv-blocks", 0)


def test_an_explicit_memory_budget_keeps_its_meaning(monkeypatch):
    """No default cap under --memory-budget-bytes: the pool is what the budget leaves, as before."""
    budget = 8 * GIB
    plan = _plan(1, monkeypatch=monkeypatch, memory_budget_bytes=budget)     # free memory is not read
    activation_and_weights = plan.weight_bytes + plan.activation_bytes
    assert plan.num_blocks == (budget - activation_and_weights - int(budget * 0.05)) // PER_BLOCK
    assert plan.num_blocks > CPU_KV_CACHE_DEFAULT_BYTES // PER_BLOCK and plan.limit == "--memory-budget-bytes"
    both = _plan(1, monkeypatch=monkeypatch, memory_budget_bytes=budget, kv_cache_memory_bytes=GIB)
    assert both.num_blocks == GIB // PER_BLOCK and both.limit == "--kv-cache-memory (1 GiB)"


def test_cuda_keeps_the_share_of_free_gpu_memory_unless_told(monkeypatch):
    plan = _plan(20 * GIB, CUDA, monkeypatch=monkeypatch)
    assert plan.num_blocks == _room_blocks(plan) > CPU_KV_CACHE_DEFAULT_BYTES // PER_BLOCK
    assert plan.limit == "--memory-fraction (0.4 of the GPU's free memory)"
    told = _plan(20 * GIB, CUDA, monkeypatch=monkeypatch, kv_cache_memory_bytes=2 * GIB)
    assert told.num_blocks == 2 * GIB // PER_BLOCK and told.limit == "--kv-cache-memory (2 GiB)"


def test_the_batch_limits_still_cap_the_pool(monkeypatch):
    plan = _plan(20 * GIB, monkeypatch=monkeypatch, sched=SchedulerConfig(max_num_seqs=2), max_model_len=1024)
    assert plan.num_blocks == 2 * 1024 // 16 + 1 and plan.limit == BATCH_LIMITS and plan.capped


def test_limits_that_leave_no_room_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match=r"--kv-cache-memory \(1 KiB\) is smaller than one KV block \(360 KiB\)"):
        _plan(20 * GIB, monkeypatch=monkeypatch, kv_cache_memory_bytes=1024)
    with pytest.raises(ValueError, match=r"\(--memory-budget-bytes\) leaves no room for the KV cache"):
        _plan(20 * GIB, monkeypatch=monkeypatch, memory_budget_bytes=WEIGHTS)
    with pytest.raises(ValueError, match=r"\(--memory-fraction \(0.4 of the memory free at start\)\) leaves no room"):
        _plan(1 << 20, monkeypatch=monkeypatch)


# --- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("2GB", 2_000_000_000), ("4 gib", 4 << 30),
    ("1.1GB", 1_100_000_000), ("64KiB", 65536), ("4096", 4096), ("10B", 10), (4096, 4096), (None, None),
    ("none", None)])
def test_sizes_parse_with_binary_and_decimal_units(text, want):
    assert parse_memory_size(text) == want


@pytest.mark.parametrize("text", ["4G", "lots", "-1GiB", "1.5", "GiB", "4 GiBs", "", True, 1.5, [4]])
def test_a_size_that_is_not_one_is_refused_saying_what_is_taken(text):
    with pytest.raises(ValueError, match=r"expected a byte count or a size such as 4GiB, 512MiB or 2GB \(units B, "):
        parse_memory_size(text)


def test_a_kv_cache_memory_of_nothing_is_refused_by_field():
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes must be a positive number of bytes, got 0") as exc:
        CacheConfig(kv_cache_memory_bytes=0)
    assert exc.value.field == "kv_cache_memory_bytes"


@pytest.mark.parametrize("n,want", [(4 << 30, "4 GiB"), (3 << 29, "1.5 GiB"), (512 << 20, "512 MiB"), (1024, "1 KiB"),
                                    (368640, "360 KiB"), (100, "100 B")])
def test_sizes_read_back_in_binary_units(n, want):
    assert format_size(n) == want
