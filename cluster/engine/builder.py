"""Building an engine's parts, in the order each needs the last: threads and cores, the model (and
what its speculator loads beside it), the KV layout, the memory plan, the attention backend, the
KV arena, the block pool, the scheduler, the runner and the decode graphs.

`LLMEngine.__init__` calls `build`; nothing here runs a request.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.config import CacheConfig, EngineConfig, format_size
from cluster.engine.graphs import DecodeGraphs, replay_factory
from cluster.engine.loaded_models import Models
from cluster.engine.runner import ModelRunner
from cluster.engine.scheduler import Gate, Scheduler
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import HiddenStatePass, SpecFootprint, Speculator
from cluster.kv.block_pool import BlockPool
from cluster.kv.kv_events import KVEventLog
from cluster.kv.paged_cache import MemoryPlan, PagedKVCache, plan_memory, resident_bytes
from cluster.kv.shared_host import SharedHostTier
from cluster.kv.tier_plan import plan_tiers
from cluster.kv.disk_io import make_file_io
from cluster.kv.tier_store import DiskTier, HostTier
from cluster.kv.tiers import KVTiers
from cluster.model.attention import make_attention_backend
from cluster.model.kernel_choice import apply_kernel_plan, engine_config_plan, plan_dtype
from cluster.model.loader import load_generation_defaults, load_model, load_tokenizer
from cluster.model.mla_engine import latent_layout, make_mla_backend
from cluster.model.model_config import ModelConfig
from cluster.model.quantize import Quantization, quantize_model
from cluster.parallel.expert_balancer import ExpertBalancer
from cluster.parallel.group import RankGroup
from cluster.parallel.kv_export import full_layout
from cluster.parallel.sharding import rank_shard, shard_model
from cluster.parallel.step_message import StepSender
from cluster.parallel.threads import rank_cores
from cluster.placement import pin_process, usable_cpus
from cluster.types import KVLayout

log = logging.getLogger(__name__)


def setup_threads(config: EngineConfig) -> torch.device:
    if config.tensor_parallel_size > 1:   # this rank's share of the worker's cores
        share = rank_cores(tuple(config.cpus or usable_cpus()), config.num_threads, config.tp_rank,
                           config.tensor_parallel_size)
        log.info("tensor parallel rank %d: %s", config.tp_rank, share.note)
        if share.cpus:
            pin_process(share.cpus)
        torch.set_num_threads(share.threads)
        return torch.device(config.device)
    if config.cpus:
        pin_process(config.cpus)
    torch.set_num_threads(config.num_threads or len(usable_cpus()))
    return torch.device(config.device)


def load_models(config: EngineConfig, device: torch.device, group: RankGroup | None = None) -> Models:
    """The target on the kernel plan, and its own KV layout (with `group`: this rank's shard)."""
    mc, model = load_model(config.model, dtype=plan_dtype(config), device=device, max_positions=config.max_model_len)
    full = mc
    if group is not None:
        mc = shard_model(model, mc, group, config.enable_expert_parallel, config.eplb.num_redundant_experts)
    dtype = model.embed_tokens.weight.dtype
    quant = quantize_model(model, mc, Quantization(config.quantization), config.model,
                           act_int8=config.quantized_activations == "int8")
    plan = engine_config_plan(config)
    log.info("kernel plan: %s", plan.describe())
    apply_kernel_plan(model, plan)
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {mc.max_position_embeddings}")
    # Quantized weights compute other KV: the layout hash tells a P/D peer with other weights apart.
    model_id = mc.model_id + (f"+w:{quant.scheme.value}" if quant is not None else "")
    model_id += "+a:int8" if config.quantized_activations == "int8" else ""
    layout = _layout(mc, model_id, mc.num_kv_layers, config, dtype)   # layers sharing K/V hold none
    shards = ()
    if group is not None:
        shards = tuple(rank_shard(full, r, group.world) for r in range(group.world))
        # A latent cache is one "KV head" that every rank holds whole (mla_sharding.py).
        layout = dataclasses.replace(layout, tp_size=group.world, tp_rank=group.rank,
                                     kv_head_start=shards[group.rank].kv_start,
                                     total_kv_heads=1 if full.mla is not None else full.num_kv_heads)
    positions = max_model_len
    if config.cache.kv_window:   # windowed sequences go on past the context: a longer RoPE table
        positions = max(max_model_len, config.cache.kv_window_max_positions)
        model.build_rotary(positions, device)
    return Models(mc, model, dtype, plan, max_model_len, layout, shards, positions)


def load_speculation(config: EngineConfig, models: Models, speculator: Speculator,
                     device: torch.device) -> SpecFootprint:
    """What `speculator` loads beside the target, before the memory plan so its real size is
    planned. Layers it keeps in the arena widen the layout, and their name goes in its model id:
    the layout hash then tells a P/D peer that its blocks carry them too. A proposer whose state
    crosses the handoff beside the blocks (the block drafter's window) names itself there as well,
    so a peer without it is refused at pairing, not at its first handoff."""
    footprint = speculator.load(models, device)
    if footprint.extra_kv_layers or footprint.model_id_suffix:
        mc = models.config
        models.layout = _layout(mc, models.layout.model_id + footprint.model_id_suffix,
                                mc.num_kv_layers + footprint.extra_kv_layers, config, models.dtype, models.layout)
    return footprint


def _layout(mc: ModelConfig, model_id: str, num_layers: int, config: EngineConfig, dtype: torch.dtype,
            base: KVLayout | None = None) -> KVLayout:
    """`base`: the layout widened (its TP share kept)."""
    if base is not None:
        return dataclasses.replace(base, model_id=model_id, num_layers=num_layers)
    if mc.mla is not None:
        return latent_layout(mc, model_id, num_layers, config.cache, str(dtype).removeprefix("torch."))
    return KVLayout(model_id=model_id, num_layers=num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                    block_size=config.cache.block_size, dtype=str(dtype).removeprefix("torch."),
                    kv_dtype=config.cache.kv_cache_dtype)


def plan_for(config: EngineConfig, models: Models, footprint: SpecFootprint, device: torch.device,
             group: RankGroup | None = None) -> MemoryPlan:
    """The memory plan of the target, its KV and what speculation takes beside them (with `group`:
    every rank the same number of blocks, the smallest any rank's memory allows)."""
    # A TP worker's rank 0 keeps a full-head export arena beside its own (cluster/parallel/kv_export.py).
    export = full_layout(models.layout).bytes_per_block() if group is not None and group.is_leader else 0
    plan = plan_memory(models.config, models.layout, config.cache, config.scheduler, models.dtype,
                       resident_bytes(models.model), models.max_model_len, device, footprint.bytes_per_block + export,
                       footprint.extra_bytes)
    if group is not None:
        plan = dataclasses.replace(plan, num_blocks=group.all_min(plan.num_blocks))
        ranks = group.all_gather_ints([plan.weight_bytes, plan.kv_bytes])
        log.info("tensor parallel, per rank: %s", "; ".join(
            f"rank {r}: weights {format_size(w)}, KV {format_size(kv)}" for r, (w, kv) in enumerate(ranks)))
    log.info("%s", plan.describe())
    return plan


@dataclass
class Core:
    """The KV cache and what drives it, built over the plan."""
    backend: object
    replay: object | None      # how decode steps replay (CUDA graphs, eager replays), or None
    kv_cache: PagedKVCache
    pool: BlockPool
    scheduler: Scheduler
    runner: ModelRunner
    tiers: KVTiers | None = None


def build_core(config: EngineConfig, models: Models, plan: MemoryPlan, device: torch.device,
               eos_token_ids: tuple[int, ...], hidden_pass: HiddenStatePass, footprint: SpecFootprint,
               on_hold: Callable[[Sequence], None] | None = None,
               admit_gate: Callable[[Sequence], Gate] | None = None, kv_events: KVEventLog | None = None,
               group: RankGroup | None = None) -> Core:
    """`on_hold`: the engine's hold hook (a prefill worker's side of the handoff), for the scheduler;
    `hidden_pass`: the speculator's pass over hidden states, wired in when `footprint.hidden_states`;
    `admit_gate`: the engine's check that the KV tiers were asked first, used when tiers are built;
    `kv_events`: where the pool and tiers report what they gain and lose (a worker's log);
    `group`: rank 0's tensor-parallel group (its runner broadcasts each pass to the other ranks)."""
    cc = config.cache
    backend = attention_backend(config, models, device)
    # Tensor parallel: each pass goes through the runner, which broadcasts it (no replays).
    replay = replay_factory(device, config.cuda_graphs) if group is None else None
    if replay is not None and config.cuda_graphs == "auto" and not backend.static_decode_ready():
        log.info("decode graphs off: the %s attention backend cannot replay static decode steps here", backend.name)
        replay = None
    # Decode graphs pad their batches into one block past the pool's (never allocated).
    kv_cache = PagedKVCache(models.layout, plan.num_blocks + (1 if replay is not None else 0), device)
    hidden = hidden_pass if footprint.hidden_states else None
    pool = BlockPool(plan.num_blocks, cc.enable_prefix_caching, on_allocate=hidden and hidden.invalidate,
                     events=kv_events)
    tiers = build_tiers(cc, plan, kv_cache, pool, device)
    if tiers is not None and kv_events is not None:
        tiers.attach_events(kv_events)
    scheduler = Scheduler(config.scheduler, pool, cc.block_size, models.max_model_len, eos_token_ids,
                          on_hold=on_hold, hit_filter=hidden and hidden.usable_hits,
                          admit_gate=admit_gate if tiers is not None and cc.enable_prefix_caching else None)
    scheduler.max_positions = max(models.max_positions, models.max_model_len)
    graphs = None
    if replay is not None and hidden is None:   # a pass over every token's hidden states runs eager
        graphs = decode_graphs(config, models, replay, models.model, kv_cache.arena, backend, plan.num_blocks,
                               device, rows_per_seq=1 + footprint.max_draft_tokens)
    sender = StepSender(group) if group is not None else None
    balancer = ExpertBalancer(config.eplb, group, sender, models.model) \
        if sender is not None and config.enable_expert_parallel and config.eplb.enable_eplb else None
    runner = ModelRunner(models.model, kv_cache.arena, backend, cc.block_size, device,
                         hidden_hook=hidden and hidden.after_forward, hidden_layers=footprint.hidden_layers,
                         graphs=graphs, step_sender=sender, balancer=balancer)
    return Core(backend, replay, kv_cache, pool, scheduler, runner, tiers)


def attention_backend(config: EngineConfig, models: Models, device: torch.device):
    mc = models.config
    if mc.mla is not None:
        return make_mla_backend(config.attention_backend, mc.mla.latent_dim, mc.num_heads, device, models.kernel_plan)
    return make_attention_backend(config.attention_backend, mc.num_heads, mc.num_kv_heads, mc.head_dim, device,
                                  models.kernel_plan, models.dtype, scale=mc.attention_scale)


def build_tiers(cache: CacheConfig, plan: MemoryPlan, kv_cache: PagedKVCache, pool: BlockPool,
                device: torch.device) -> KVTiers | None:
    """The KV tiers below the pool, when configured: planned (or refused), then hooked to the pool."""
    block_bytes = kv_cache.nbytes() // kv_cache.num_blocks
    tier_plan = plan_tiers(cache, plan, block_bytes, device)
    if not tier_plan.enabled:
        return None
    log.info("%s", tier_plan.describe())
    disk = None
    if tier_plan.disk_dir is not None:
        disk = DiskTier(tier_plan.disk_dir, kv_cache.layout.layout_hash(), tier_plan.disk_blocks * block_bytes,
                        make_file_io(block_bytes, cache.kv_disk_io))
        if disk.recovered:
            log.info("KV disk tier: %d blocks found in %s (reused)", disk.recovered, disk.dir)
    arena = kv_cache.arena
    block_shape = tuple(arena[:, :, 0].shape)
    if cache.kv_host_shared and tier_plan.host_blocks:
        host = SharedHostTier(cache.kv_host_shared, tier_plan.host_blocks, block_shape, arena.dtype,
                              kv_cache.layout.layout_hash())
    else:
        host = HostTier(tier_plan.host_blocks, block_shape, arena.dtype, pin=device.type == "cuda")
    tiers = KVTiers(pool, arena, host, disk)
    pool.on_cached = tiers.offload
    return tiers


def decode_graphs(config: EngineConfig, models: Models, replay, model, arena: torch.Tensor, backend,
                  pad_block: int, device: torch.device, rows_per_seq: int = 1) -> DecodeGraphs:
    """Decode graphs of `model` over `arena` for every batch bucket up to max_num_seqs
    sequences of `rows_per_seq` rows (the widest verification)."""
    bs, buckets = config.cache.block_size, models.kernel_plan.buckets
    limit = config.scheduler.max_num_seqs * rows_per_seq
    sizes = [s for s in buckets.sizes if s < limit] + [buckets.bucket(limit)]
    return DecodeGraphs(model, arena, backend, bs, device, sizes, -(-models.max_model_len // bs), pad_block, replay)


def tokenizer_and_defaults(config: EngineConfig):
    return load_tokenizer(config.model), load_generation_defaults(config.model)
