"""The simulator against real clusters here: predicted vs measured TTFT and ITL, p50 and p99.

    python bench/simulator_fidelity.py [--profile cluster/planner/cpu-default.json]
        [--modes pd,colocated] [--levels 1,2,4] [--requests 8] [--prompt-tokens 128] [--max-tokens 32]
        [--out bench/results/simulator_fidelity.json] [--reuse]
    python bench/simulator_fidelity.py --arrivals poisson [--rates 1,2.5,4] [--duration 60] ...

For each mode (`pd`: `splitserve serve --prefill 1 --decode 1`; `colocated`), bench/servers.py
starts the cluster (bf16, no quantization, one torch thread per worker: the settings the default
profile was measured with, `bench/planner_profile.py --dtype bfloat16 --quantization none --threads 1`)
and bench/loadgen.py drives it over gRPC: at each level, that many streams send random prompts back
to back (greedy, eos ignored, each exactly --max-tokens tokens). The simulator runs the same
closed loop (same streams, prompt and completion lengths) on the profile. A request's ITL is its
mean gap between tokens after the first, in both. Two predictions per row: from the profile as
measured, and from the profile calibrated on the one-stream level (its prefill and decode costs
scaled so that the simulator's 1-stream TTFT and ITL p50 equal the measured ones: the cluster's
own step costs, as an online planner fits them); the levels above one stream test the model's
queueing and batching out of sample. Prints one row per mode, level and metric, with the errors
(predicted / measured - 1); the goal is p50 within 15%, p99 within 30%. The machine's load
average is printed beside: figures from a busy machine are noisy. --reuse predicts again from the
measurements --out already holds, without starting a cluster.

--arrivals poisson: open-loop loads instead of closed-loop streams, as the planner meets them:
at each rate (requests/s) a Poisson trace of --duration seconds (seeded; the same arrival times
given to the simulator), each request sent at its arrival time whatever the cluster's state
(bench/planner_live.py's driver), fixed prompt and completion lengths. Closed-loop streams that
start together run in lock-step, so their TTFTs split into two modes (a prompt alone in a pass,
or packed with the others) and a p50 over a few requests falls in either; independent arrivals
have no such artefact. The lowest rate is the calibration level.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

from planner_live import drive
from servers import start_splitserve

from cluster.config import default_model_dir
from cluster.planner.costs import load_profile
from cluster.planner.sim_metrics import percentile
from cluster.planner.simulator import SimConfig, Simulator
from cluster.planner.traces import Shape, TraceRequest, poisson
from router.policy import WorkerView, make_policy

DEFAULT_PROFILE = REPO / "cluster" / "planner" / "cpu-default.json"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def measure(mode: str, args, tmp: Path) -> dict[int, list[dict]]:
    """Per level: loadgen's records of a real cluster of `mode`."""
    rng = random.Random(0)
    def prompts(n):
        return [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(n)]
    server = start_splitserve(mode, default_model_dir(), tmp / f"{mode}.log", threads=1)
    try:
        spec = {"backend": "splitserve", "target": server.target, "max_tokens": args.max_tokens,
                "warmup": {"concurrency": 2, "prompts": prompts(2)},
                "levels": [{"concurrency": c, "prompts": prompts(args.requests)} for c in args.levels]}
        (tmp / "spec.json").write_text(json.dumps(spec))
        subprocess.run([sys.executable, str(REPO / "bench" / "loadgen.py"), str(tmp / "spec.json"),
                        str(tmp / "out.json")], check=True, cwd=REPO)
        levels = json.loads((tmp / "out.json").read_text())["levels"]
    finally:
        server.stop()
    return {lv["concurrency"]: lv["results"] for lv in levels}


def poisson_trace(rate: float, args) -> list[TraceRequest]:
    return poisson(rate, args.duration, Shape(args.prompt_tokens, args.max_tokens, spread=0.0), seed=7)


def measure_open(mode: str, args, tmp: Path) -> dict[float, list[dict]]:
    """Per rate: the records of a real cluster of `mode` under that rate's Poisson trace."""
    server = start_splitserve(mode, default_model_dir(), tmp / f"{mode}.log", threads=1)
    try:
        asyncio.run(drive(server.target, [TraceRequest(0.0, args.prompt_tokens, args.max_tokens)] * 2,
                          random.Random(5)))    # warm-up
        out = {}
        for rate in args.rates:
            records = asyncio.run(drive(server.target, poisson_trace(rate, args), random.Random(1)))
            failed = [r for r in records if "error" in r]
            if failed:
                raise RuntimeError(f"{len(failed)} request(s) failed at {rate}/s, first: {failed[0]['error']}")
            out[rate] = [{"ttft": r["ttft"], "itl": [r["itl"]]} for r in records]
            print(f"  {mode}: {rate}/s done, {len(records)} requests", flush=True)
    finally:
        server.stop()
    return out


def measured_figures(records: list[dict]) -> dict[str, float]:
    ttft = [r["ttft"] for r in records]
    itl = [sum(r["itl"]) / len(r["itl"]) for r in records if r["itl"]]
    return figures(ttft, itl)


def figures(ttft: list[float], itl: list[float]) -> dict[str, float]:
    return {"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99)}


def predict(mode: str, level: float, args, costs) -> dict[str, float]:
    """The simulator's figures for one level: `level` streams (closed loop) or requests/s (poisson)."""
    if args.arrivals == "poisson":
        trace, streams = poisson_trace(level, args), None
    else:
        trace, streams = [TraceRequest(0.0, args.prompt_tokens, args.max_tokens)] * args.requests, int(level)
    colocated = mode == "colocated"
    cfg = SimConfig(0 if colocated else 1, 1, ttft_slo_s=1e9, itl_slo_s=1e9, colocated=colocated,
                    closed_loop=streams)
    sim = Simulator(costs, cfg, make_policy("prefix_aware"), WorkerView)
    sim.run(trace)
    done = [r for r in sim.requests if r.done_s is not None]
    itl = [(r.done_s - r.first_token_s) / (r.trace.output_tokens - 1) for r in done]
    return figures([r.first_token_s - r.arrival_s for r in done], itl)


def calibrated(mode: str, records: list[dict], args, costs):
    """`costs` scaled so that the lowest level's predicted TTFT and ITL p50 match `records`."""
    measured, predicted = measured_figures(records), predict(mode, args.levels[0], args, costs)
    return costs.scaled(measured["ttft_p50"] / predicted["ttft_p50"], measured["itl_p50"] / predicted["itl_p50"])


def error(predicted: float, measured: float) -> float | None:
    return predicted / measured - 1 if measured else None


def compare(mode: str, measured: dict, args, costs) -> list[dict]:
    first = args.levels[0]
    fitted = calibrated(mode, measured[first], args, costs) if first in measured else costs
    rows = []
    for c in args.levels:
        m, p, f = measured_figures(measured[c]), predict(mode, c, args, costs), predict(mode, c, args, fitted)
        rows += [{"mode": mode, "streams": c, "metric": key, "measured_s": m[key], "profile_s": p[key],
                  "calibrated_s": f[key], "profile_error": error(p[key], m[key]),
                  "calibrated_error": error(f[key], m[key])} for key in m]
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'mode':<10} {'streams':>7} {'metric':<9} {'measured':>9} {'profile':>9} {'error':>6} "
          f"{'calibrated':>10} {'error':>6}")
    for r in rows:
        def pct(x):
            return "n/a" if x is None else f"{x:+.0%}"
        print(f"{r['mode']:<10} {r['streams']:>7g} {r['metric']:<9} {r['measured_s'] * 1e3:>7.0f}ms "
              f"{r['profile_s'] * 1e3:>7.0f}ms {pct(r['profile_error']):>6} {r['calibrated_s'] * 1e3:>8.0f}ms "
              f"{pct(r['calibrated_error']):>6}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    ap.add_argument("--modes", default="pd,colocated")
    ap.add_argument("--levels", type=ints, default=ints("1,2,4"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "simulator_fidelity.json")
    ap.add_argument("--reuse", action="store_true", help="predict from the measurements --out holds")
    ap.add_argument("--arrivals", choices=("closed", "poisson"), default="closed")
    ap.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], default=[1.0, 2.5, 4.0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of each rate's Poisson trace")
    args = ap.parse_args()
    if args.arrivals == "poisson":
        args.levels = args.rates
    costs = load_profile(args.profile)
    measured = {}
    if args.reuse:
        key = float if args.arrivals == "poisson" else int
        measured = {mode: {key(c): recs for c, recs in levels.items()}
                    for mode, levels in json.loads(args.out.read_text())["measured"].items()}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in args.modes.split(","):
                load_before = os.getloadavg()[0]
                run = measure_open if args.arrivals == "poisson" else measure
                measured[mode] = run(mode, args, Path(tmp))
                busy = " (CPU busy with other work: busy-machine figures)" if load_before > 1.0 else ""
                print(f"{mode}: load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
                      f"{os.cpu_count()} cores{busy}", flush=True)
    rows = [row for mode in measured for row in compare(mode, measured[mode], args, costs)]
    print_rows(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"profile": str(args.profile), "rows": rows, "measured": measured}) + "\n")


if __name__ == "__main__":
    main()
