"""`splitserve plan`: the P:D split, the workers and each worker's memory for a rate and SLOs, with
the latencies the planner's model predicts (cluster/planner/capacity.py) and the simulator's
check of them on a Poisson trace. Memory comes from the engine's own memory plan
(cluster/kv/paged_cache.py `plan_memory`) over the model's config; torch for its dtypes."""
from __future__ import annotations

import torch

from cluster.config import (
    CacheConfig,
    SchedulerConfig,
    default_model_dir,
    format_size,
    resolve_model,
)
from cluster.kv.paged_cache import MemoryPlan, plan_memory
from cluster.launch.invocation import CommandError, Invocation
from cluster.model.mla_engine import latent_layout
from cluster.model.model_config import ModelConfig, load_model_config
from cluster.planner.capacity import Load, Split, choose_split
from cluster.planner.costs import DeviceProfile, load_profile
from cluster.planner.simulator import SimConfig, Simulator
from cluster.planner.traces import Shape, make_trace
from cluster.types import KVLayout
from router.policy import WorkerView, make_policy

SIMULATED_S = 60.0
MAX_SIMULATED_WORKERS = 200


def memory_plan(mc: ModelConfig, costs: DeviceProfile, model_id: str) -> MemoryPlan:
    """One worker's plan: on the profile's device memory when it gives one (`memory.device_bytes`),
    else on this machine's defaults."""
    dtype = getattr(torch, costs.memory.get("dtype", "bfloat16"))
    cache, sched = CacheConfig(), SchedulerConfig(max_num_seqs=costs.max_num_seqs,
                                                  max_num_batched_tokens=costs.max_num_batched_tokens)
    device = torch.device("cpu")
    if costs.memory.get("device_bytes"):
        cache, device = CacheConfig(memory_budget_bytes=int(costs.memory["device_bytes"])), torch.device("cuda")
    dtype_name = str(dtype).removeprefix("torch.")
    layout = (latent_layout(mc, model_id, mc.num_layers, cache, dtype_name) if mc.mla is not None else
              KVLayout(model_id=model_id, num_layers=mc.num_kv_layers, num_kv_heads=mc.num_kv_heads,
                       head_dim=mc.head_dim, block_size=cache.block_size, dtype=dtype_name))
    weights = mc.num_parameters() * torch.empty((), dtype=dtype).element_size()
    return plan_memory(mc, layout, cache, sched, dtype, weights, mc.max_position_embeddings, device)


def describe_split(split: Split, load: Load, args) -> list[str]:
    fits = "both SLOs met" if split.fits_budget else f"over the budget of {args.max_workers}: SLOs not met"
    return [f"split: {split.prefill} prefill + {split.decode} decode = {split.workers} workers ({fits})",
            (f"predicted (model): TTFT {split.ttft_s * 1e3:.0f} ms, ITL {split.itl_s * 1e3:.1f} ms at "
             f"{load.rate:g} req/s of {load.input_tokens:g} + {load.output_tokens:g} tokens")]


def simulated(costs: DeviceProfile, split: Split, args) -> str:
    if split.workers > MAX_SIMULATED_WORKERS:
        return f"simulated: skipped (more than {MAX_SIMULATED_WORKERS} workers; `splitserve simulate` runs it)"
    trace = make_trace("poisson", args.rate, SIMULATED_S, Shape(args.input_tokens, args.output_tokens))
    cfg = SimConfig(split.prefill, split.decode, args.ttft_slo, args.itl_slo)
    r = Simulator(costs, cfg, make_policy("prefix_aware"), WorkerView).run(trace)
    return (f"simulated (Poisson, {SIMULATED_S:g} s): TTFT p50 {r.ttft_p50_s * 1e3:.0f} ms, p99 "
            f"{r.ttft_p99_s * 1e3:.0f} ms; ITL p50 {r.itl_p50_s * 1e3:.1f} ms, p99 {r.itl_p99_s * 1e3:.1f} ms; "
            f"goodput {r.goodput:.1%}")


def cmd_plan(inv: Invocation) -> int:
    args = inv.args
    try:
        costs = load_profile(args.device_profile)
        model_dir = resolve_model(args.model) if args.model else default_model_dir()
        mc = load_model_config(model_dir)
    except (OSError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    load = Load(args.rate, args.input_tokens, args.output_tokens)
    split = choose_split(costs, load, args.ttft_slo, args.itl_slo, args.max_workers)
    mem = memory_plan(mc, costs, model_dir.name)
    print(f"plan: {model_dir.name}, {args.rate:g} req/s, TTFT SLO {args.ttft_slo:g} s, ITL SLO {args.itl_slo:g} s; "
          f"step costs from {costs.name} ({costs.device or 'device'})")
    for line in describe_split(split, load, args):
        print(line)
    print(f"memory per worker: weights {format_size(mem.weight_bytes)}, KV {format_size(mem.kv_bytes)} "
          f"({mem.num_blocks} blocks, set by {mem.limit}), activations {format_size(mem.activation_bytes)}, "
          f"headroom {format_size(mem.headroom_bytes)}; budget {format_size(mem.budget_bytes)}")
    print(simulated(costs, split, args))
    return 0
