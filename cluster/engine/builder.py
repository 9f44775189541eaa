"""Building an engine's parts, in the order each needs the last: threads and cores, the model (and
an EAGLE head or a draft model, for speculation), the KV layout, the memory plan, the attention
backend, the KV arena, the block pool, the scheduler, the runner and the decode graphs.

`LLMEngine.__init__` calls `build`; nothing here runs a request.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig
from cluster.engine.graphs import DecodeGraphs, replay_factory
from cluster.engine.runner import ModelRunner
from cluster.engine.scheduler import Scheduler
from cluster.kv.block_pool import BlockPool
from cluster.kv.paged_cache import MemoryPlan, PagedKVCache, draft_footprint, plan_memory, resident_bytes
from cluster.model.attention import make_attention_backend
from cluster.model.kernel_choice import apply_kernel_plan, engine_config_plan
from cluster.model.kernel_plan import KernelPlan
from cluster.model.loader import load_generation_defaults, load_model, load_tokenizer
from cluster.model.model_config import TORCH_DTYPES, ModelConfig
from cluster.model.spec_compat import check_speculative_models
from cluster.placement import pin_process, usable_cpus
from cluster.types import KVLayout

log = logging.getLogger(__name__)


@dataclass
class Models:
    """What `load_models` loads: the target, and what speculation adds to it."""
    config: ModelConfig
    model: torch.nn.Module
    dtype: torch.dtype
    kernel_plan: KernelPlan
    max_model_len: int
    layout: KVLayout
    eagle: torch.nn.Module | None = None            # an EAGLE head: its KV is one more layer of the arena
    draft_config: ModelConfig | None = None         # a draft model (decode/spec/draft_model.py runs it)
    draft_model: torch.nn.Module | None = None


def setup_threads(config: EngineConfig) -> torch.device:
    if config.cpus:
        pin_process(config.cpus)
    torch.set_num_threads(config.num_threads or len(usable_cpus()))
    return torch.device(config.device)


def load_models(config: EngineConfig, device: torch.device, with_draft: bool) -> Models:
    """The target on the kernel plan; an EAGLE head when the method is eagle (a prefill worker
    computes the head's KV too); a draft model only for an engine that speculates (`with_draft`),
    loaded here, before the memory plan, so its real size is planned."""
    dtype = None if config.dtype == "auto" else TORCH_DTYPES[config.dtype]
    mc, model = load_model(config.model, dtype=dtype, device=device, max_positions=config.max_model_len)
    dtype = model.embed_tokens.weight.dtype
    plan = engine_config_plan(config)
    log.info("kernel plan: %s", plan.describe())
    apply_kernel_plan(model, plan)
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {mc.max_position_embeddings}")
    check_speculative_models(config, disaggregated=False)   # a draft or head that cannot work
    spec = config.speculative
    models = Models(mc, model, dtype, plan, max_model_len, _layout(mc, mc.model_id, mc.num_layers, config, dtype))
    if spec.method == "eagle":
        # The head's KV is one more layer of the arena; the layout hash then tells a P/D peer
        # that its blocks carry the head's KV too.
        from cluster.model.eagle import load_eagle_head  # noqa: PLC0415
        models.eagle = load_eagle_head(spec.eagle_dir, mc, model, dtype, device)
        apply_kernel_plan(models.eagle, plan)
        models.layout = _layout(mc, f"{mc.model_id}+eagle:{spec.eagle_dir.name}", mc.num_layers + 1, config, dtype)
    elif spec.method == "draft" and with_draft:
        models.draft_config, models.draft_model = load_model(spec.draft_dir, dtype=dtype, device=device,
                                                             max_positions=max_model_len)
        apply_kernel_plan(models.draft_model, plan)
    return models


def _layout(mc: ModelConfig, model_id: str, num_layers: int, config: EngineConfig, dtype: torch.dtype) -> KVLayout:
    return KVLayout(model_id=model_id, num_layers=num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                    block_size=config.cache.block_size, dtype=str(dtype).removeprefix("torch."))


def plan_for(config: EngineConfig, models: Models, device: torch.device) -> MemoryPlan:
    """The memory plan of the target, its KV and what a draft model takes beside them."""
    draft_per_block, draft_bytes = (0, 0) if models.draft_model is None else draft_footprint(
        models.draft_model, models.draft_config, config, models.layout.dtype)
    plan = plan_memory(models.config, models.layout, config.cache, config.scheduler, models.dtype,
                       resident_bytes(models.model), models.max_model_len, device, draft_per_block, draft_bytes)
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


def build_core(config: EngineConfig, models: Models, plan: MemoryPlan, device: torch.device,
               eos_token_ids: tuple[int, ...]) -> Core:
    mc, cc = models.config, config.cache
    backend = make_attention_backend(config.attention_backend, mc.num_heads, mc.num_kv_heads, mc.head_dim, device,
                                     models.kernel_plan, models.dtype, scale=mc.attention_scale)
    replay = replay_factory(device, config.cuda_graphs)
    if replay is not None and config.cuda_graphs == "auto" and not backend.static_decode_ready():
        log.info("decode graphs off: the %s attention backend cannot replay static decode steps here", backend.name)
        replay = None
    # Decode graphs pad their batches into one block past the pool's (never allocated).
    kv_cache = PagedKVCache(models.layout, plan.num_blocks + (1 if replay is not None else 0), device)
    pool = BlockPool(plan.num_blocks, cc.enable_prefix_caching)
    scheduler = Scheduler(config.scheduler, pool, cc.block_size, models.max_model_len, eos_token_ids)
    runner = ModelRunner(models.model, kv_cache.arena, backend, cc.block_size, device)
    if models.eagle is not None:
        runner.attach_eagle(models.eagle, pool.num_blocks, mc.hidden_size, models.dtype)
        pool.on_allocate = runner.invalidate_features
        scheduler.hit_filter = runner.usable_hits
    return Core(backend, replay, kv_cache, pool, scheduler, runner)


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
