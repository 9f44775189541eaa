"""`splitserve simulate`: the SLA planner against a fixed split on a simulated cluster, the same
trace for both (cluster/planner/simulator.py). Prints TTFT and ITL p50/p99 and goodput."""
from __future__ import annotations

import time

from cluster.launch.invocation import CommandError, Invocation
from cluster.planner.capacity import Load, choose_split
from cluster.planner.costs import DeviceProfile, load_profile
from cluster.planner.rule import FixedRule, RuleConfig, SlaRule
from cluster.planner.simulator import SimConfig, Simulator
from cluster.planner.traces import Shape, make_trace
from router.policy import WorkerView, make_policy


def mean_load_split(costs: DeviceProfile, args, trace) -> tuple[int, int]:
    """The split sized for the trace's mean load and lengths (the fixed baseline), within the budget."""
    n = max(len(trace), 1)
    load = Load(len(trace) / args.duration, sum(r.input_tokens for r in trace) / n,
                sum(r.output_tokens for r in trace) / n)
    split = choose_split(costs, load, args.ttft_slo, args.itl_slo, args.workers)
    return split.prefill, split.decode


def simulate(costs: DeviceProfile, args, planner: str, start: tuple[int, int], trace) -> str:
    rule = SlaRule(RuleConfig(args.ttft_slo, args.itl_slo, args.workers), costs) if planner == "sla" else FixedRule()
    cfg = SimConfig(start[0], start[1], args.ttft_slo, args.itl_slo, planner_interval_s=args.planner_interval,
                    seed=args.seed)
    t0 = time.process_time()
    result = Simulator(costs, cfg, make_policy("prefix_aware"), WorkerView, rule).run(trace)
    cpu = time.process_time() - t0
    return f"{planner:>5} (start {start[0]}P{start[1]}D): {result.describe()}; CPU {cpu:.2f} s"


def cmd_simulate(inv: Invocation) -> int:
    args = inv.args
    try:
        costs = load_profile(args.profile)
    except (OSError, ValueError) as exc:
        raise CommandError(f"--profile: {exc}") from None
    trace = make_trace(args.trace, args.rate, args.duration, Shape(args.input_tokens, args.output_tokens), args.seed,
                       args.burst_period)
    if (args.prefill is None) != (args.decode is None):
        raise CommandError("--prefill and --decode go together (neither: the split sized for the mean load)")
    start = (args.prefill, args.decode) if args.prefill else mean_load_split(costs, args, trace)
    if sum(start) > args.workers:
        raise CommandError(f"--prefill {start[0]} + --decode {start[1]} is more than --workers {args.workers}")
    print(f"simulate: {args.trace} trace, mean {args.rate:g} req/s for {args.duration:g} s ({len(trace)} requests), "
          f"budget {args.workers} workers, TTFT SLO {args.ttft_slo:g} s, ITL SLO {args.itl_slo:g} s, profile "
          f"{costs.name} ({costs.device or 'device'})", flush=True)
    for planner in (("sla", "fixed") if args.planner == "both" else (args.planner,)):
        print(simulate(costs, args, planner, start, trace), flush=True)
    return 0
