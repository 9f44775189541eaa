"""The expert balancer (--enable-eplb) on a skewed load: max/mean (token, expert) pairs per rank
before and after the balancer moved and replicated experts, measured on the ranks' own counters,
with decode step times beside them; and why each role balances from its own load: the prefill
load's imbalance under its own placement against under the decode load's placement.

    PYTHONPATH=. python bench/eplb.py [--ranks 2] [--redundant 0 4] [--steps 24]

The model: bench/tp.py's Qwen3-30B-A3B shape cut to 4 layers (64 experts of 384, top-8, hidden
1024, random weights). The skew: prompts drawn from 16 token ids (a narrow topic), so routing
concentrates on the experts those tokens choose. A benchmark, not a test: step times depend on
what else runs (printed beside them); the balance figures do not.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

from tp import moe_checkpoint

from cluster.config import EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.eplb_config import ExpertBalanceConfig
from cluster.parallel.expert_balancer import placed_experts
from cluster.parallel.expert_placement import BalancePolicy, balance, contiguous_placement, imbalance
from cluster.types import SamplingParams

TOPIC = 16   # distinct token ids the prompts use


def topic_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(2000, generator=torch.Generator().manual_seed(1))[:TOPIC] + 100
    return [vocab[torch.randint(0, TOPIC, (length,), generator=g)].tolist() for _ in range(n)]


def _counters(engine: LLMEngine) -> tuple[list[list[int]], list[list[int]]]:
    layers = placed_experts(engine.model)
    return [layer.token_counts() for layer in layers], [layer.rank_tokens.tolist() for layer in layers]


def _delta(after: list[list[int]], before: list[list[int]]) -> list[list[float]]:
    return [[float(a - b) for a, b in zip(x, y)] for x, y in zip(after, before)]


def run_phase(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    """`batch` topic prompts decoded `steps` tokens: the expert and rank loads of the phase and
    the decode step time (prefill passes excluded)."""
    experts0, ranks0 = _counters(engine)
    sampling = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for p in topic_prompts(batch, prompt_len, seed):
        engine.add_request(p, sampling)
    while engine.scheduler.waiting or any(s.num_output_tokens < 1 for s in engine.scheduler.running):
        engine.step()
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    ms = 1e3 * (time.perf_counter() - t0) / max(n, 1)
    experts1, ranks1 = _counters(engine)
    return {"experts": _delta(experts1, experts0), "ranks": _delta(ranks1, ranks0), "ms": ms}


def max_over_mean(rank_loads: list[list[float]]) -> float:
    """The busiest rank's share against an even split, averaged over layers."""
    return statistics.mean(max(r) / (sum(r) / len(r)) for r in rank_loads if sum(r) > 0)


def one_setting(model: Path, ranks: int, redundant: int, args) -> dict:
    eplb = ExpertBalanceConfig(enable_eplb=True, num_redundant_experts=redundant, eplb_step_interval=10**9,
                               eplb_min_gain=0.0)
    engine = LLMEngine(EngineConfig(model=model, quantization="none", dtype=args.dtype, num_threads=2,
                                    tensor_parallel_size=ranks, enable_expert_parallel=True, eplb=eplb,
                                    scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024)))
    try:
        run_phase(engine, 2, 16, 4, 0)                      # warm-up
        engine.runner.balancer.seen = _counters(engine)[0]  # the balancer sees the measured phase only
        before = run_phase(engine, args.batch, 32, args.steps, 1)
        look = engine.runner.balancer.look()
        same = run_phase(engine, args.batch, 32, args.steps, 1)    # the same prompts again
        held_out = run_phase(engine, args.batch, 32, args.steps, 2)  # new prompts of the same topic
        return {"before": max_over_mean(before["ranks"]), "same": max_over_mean(same["ranks"]),
                "held_out": max_over_mean(held_out["ranks"]), "ms_before": before["ms"],
                "ms_after": held_out["ms"], "applied": look.applied}
    finally:
        engine.close()


def role_loads(model: Path, ranks: int, args, seed: int) -> dict:
    """Expert loads of a prefill-shaped phase (long prompts, one token) and a decode-shaped one."""
    engine = LLMEngine(EngineConfig(model=model, quantization="none", dtype=args.dtype, num_threads=2,
                                    tensor_parallel_size=ranks, enable_expert_parallel=True,
                                    scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024)))
    try:
        experts0, _ = _counters(engine)
        engine.generate(topic_prompts(4, 256, seed), SamplingParams(max_tokens=1))
        experts1, _ = _counters(engine)
        prefill = _delta(experts1, experts0)
        decode = run_phase(engine, args.batch, 8, args.steps, seed + 1)["experts"]
        return {"prefill": prefill, "decode": decode}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--redundant", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    model = moe_checkpoint(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    print(f"Qwen3-MoE shape, 4 layers, 64 experts top-8, {args.dtype}; {args.ranks} ranks (EP); "
          f"decode batch {args.batch}, {args.steps} steps a phase; prompts from {TOPIC} token ids")
    print("max/mean (token, expert) pairs per rank, mean over the 4 layers, on the ranks' counters:")
    print("| redundant slots | before (contiguous) | after, same prompts | after, new prompts of the topic | "
          "decode ms a step before | after |")
    print("|---:|---:|---:|---:|---:|---:|")
    for redundant in args.redundant:
        r = one_setting(model, args.ranks, redundant, args)
        print(f"| {redundant} | {r['before']:.3f} | {r['same']:.3f} | {r['held_out']:.3f} | "
              f"{r['ms_before']:.1f} | {r['ms_after']:.1f} |")
    fit, held = role_loads(model, args.ranks, args, 5), role_loads(model, args.ranks, args, 7)
    redundant = max(args.redundant)
    print(f"\nEach role from its own load ({redundant} redundant slots): placements fitted on one sample of a role's "
          "load, max/mean per rank on another sample (held out), mean over layers:")
    print("| held-out load | placement from the same role | from the other role | contiguous |")
    print("|---|---:|---:|---:|")
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        own = [imbalance(load, balance(f, args.ranks, redundant, BalancePolicy.GLOBAL))
               for load, f in zip(held[role], fit[role])]
        cross = [imbalance(load, balance(o, args.ranks, redundant, BalancePolicy.GLOBAL))
                 for load, o in zip(held[role], fit[other])]
        base = [imbalance(load, contiguous_placement(len(load), args.ranks))
                for load in held[role]]
        print(f"| {role} | {statistics.mean(own):.3f} | {statistics.mean(cross):.3f} | "
              f"{statistics.mean(base):.3f} |")


if __name__ == "__main__":
    main()
