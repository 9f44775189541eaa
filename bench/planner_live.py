"""The SLA planner against the fixed split it starts from, on a live cluster here, on a bursty load.

    python bench/planner_live.py [--rate 1.0] [--period 120] [--duration 240] [--input-tokens 256]
        [--output-tokens 64] [--ttft-slo 2] [--itl-slo 0.15] [--max-workers 3] [--interval 10]
        [--configs fixed,planner] [--out bench/results/planner_live.json]

Each configuration is `splitserve serve --prefill 1 --decode 1` (bf16, no quantization, one torch
thread per worker, NIXL), `planner` adding `--planner sla` with the SLOs, `--max-workers` and
`--planner-interval`. The load is open-loop: the simulator's bursty trace (cluster/planner/traces.py:
the rate swings sinusoidally from 0.1x to 1.9x the mean), each request sent at its arrival time
over gRPC whatever the cluster's state (a closed loop would slow down with the cluster and hide
the queue the planner must see), random token prompts, greedy, `ignore_eos` (exactly its output
length). Printed per configuration: goodput (the share of requests within both SLOs: TTFT, and
the mean gap between tokens after the first), TTFT and ITL p50/p99, errors, the workers per role
over time (sampled through the Admin `ListWorkers` RPC every 2 s) and how busy the machine's cores
were (from /proc/stat over the run): on a machine whose cores the fixed split already keeps busy,
a worker more adds no compute, which is what this prints beside the goodput.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

from servers import start_splitserve

from cluster.config import default_model_dir
from cluster.planner.sim_metrics import percentile
from cluster.planner.traces import Shape, make_trace
from proto.splitserve.v1 import inference_pb2 as pb
from router.client import AsyncClient, Client


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat's first line."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]          # idle + iowait
    return sum(fields) - idle, sum(fields)


class WorkerSampler:
    """The workers per role every `every_s`, through the Admin RPC, on a thread of its own."""

    def __init__(self, target: str, every_s: float = 2.0):
        self.client, self.every_s, self.t0 = Client(target), every_s, time.monotonic()
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                reply = self.client.admin("ListWorkers", pb.ListWorkersRequest(), timeout=5)
            except Exception as exc:  # noqa: BLE001 - a sample lost is printed, not fatal
                self.samples.append({"t": time.monotonic() - self.t0, "error": str(exc)[:120]})
                continue
            roles: dict[str, int] = {}
            for w in reply.workers:
                if w.state == "serving":
                    roles[w.role] = roles.get(w.role, 0) + 1
            self.samples.append({"t": round(time.monotonic() - self.t0, 1), **roles})

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()


async def drive(target: str, trace, vocab_rng: random.Random) -> list[dict]:
    """Send each trace request at its arrival time; one record per request."""
    client = AsyncClient(target)
    prompts = [[vocab_rng.randrange(100, 40000) for _ in range(r.input_tokens)] for r in trace]
    t0 = time.perf_counter()

    async def one(i: int) -> dict:
        req = trace[i]
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
        sent, times = time.perf_counter(), []
        try:
            async for msg in client.stream(prompts[i], max_tokens=req.output_tokens, temperature=0.0,
                                           ignore_eos=True, timeout=600):
                times.extend([time.perf_counter()] * len(msg.token_ids))
        except Exception as exc:  # noqa: BLE001 - counted, never fatal
            return {"arrival": req.arrival_s, "error": f"{type(exc).__name__}: {str(exc)[:120]}"}
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return {"arrival": req.arrival_s, "ttft": times[0] - sent if times else None,
                "itl": sum(gaps) / len(gaps) if gaps else 0.0, "tokens": len(times)}
    try:
        return await asyncio.gather(*(one(i) for i in range(len(trace))))
    finally:
        await client.close()


def summarize(records: list[dict], args) -> dict:
    done = [r for r in records if "error" not in r and r["ttft"] is not None]
    good = [r for r in done if r["ttft"] <= args.ttft_slo and r["itl"] <= args.itl_slo]
    ttft, itl = [r["ttft"] for r in done], [r["itl"] for r in done]
    return {"requests": len(records), "errors": len(records) - len(done),
            "goodput": len(good) / len(records) if records else 0.0,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99)}


def run_config(name: str, args, trace, tmp: Path) -> dict:
    extra = []
    if name == "planner":
        extra = ["--planner", "sla", "--ttft-slo", str(args.ttft_slo), "--itl-slo", str(args.itl_slo),
                 "--max-workers", str(args.max_workers), "--planner-interval", str(args.interval)]
    server = start_splitserve("pd", default_model_dir(), tmp / f"{name}.log", threads=1, extra_args=extra)
    try:
        busy0, total0 = cpu_times()
        with WorkerSampler(server.target) as sampler:
            records = asyncio.run(drive(server.target, trace, random.Random(1)))
        busy1, total1 = cpu_times()
    finally:
        server.stop()
    result = summarize(records, args)
    result["cores_busy"] = round((busy1 - busy0) / (total1 - total0) * (os.cpu_count() or 1), 2)
    result["workers"] = sampler.samples
    result["records"] = records
    return result


def print_result(name: str, r: dict) -> None:
    peak = max((s.get("prefill", 0) + s.get("decode", 0) for s in r["workers"] if "error" not in s), default=0)
    print(f"{name:8s} goodput {r['goodput']:.1%}  errors {r['errors']}/{r['requests']}  "
          f"TTFT p50/p99 {r['ttft_p50']:.2f}/{r['ttft_p99']:.2f} s  ITL p50/p99 {r['itl_p50'] * 1e3:.0f}/"
          f"{r['itl_p99'] * 1e3:.0f} ms  cores busy {r['cores_busy']} of {os.cpu_count()}  most workers {peak}")
    changes, last = [], None
    for s in r["workers"]:
        shape = (s.get("prefill", 0), s.get("decode", 0)) if "error" not in s else None
        if shape is not None and shape != last:
            changes.append(f"t={s['t']:.0f}s {shape[0]}P{shape[1]}D")
            last = shape
    print("         workers: " + ", ".join(changes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1.0, help="mean requests per second")
    ap.add_argument("--period", type=float, default=120.0, help="the bursty trace's period, seconds")
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--input-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--itl-slo", type=float, default=0.15)
    ap.add_argument("--max-workers", type=int, default=3)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--configs", default="fixed,planner")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "planner_live.json")
    args = ap.parse_args()
    trace = make_trace("bursty", args.rate, args.duration, Shape(args.input_tokens, args.output_tokens),
                       seed=args.seed, period_s=args.period)
    print(f"bursty trace: {len(trace)} requests over {args.duration:.0f} s, mean {args.rate}/s "
          f"(0.1x-1.9x, period {args.period:.0f} s); load average before: {os.getloadavg()[0]:.1f}")
    results = {}
    logs = args.out.parent / (args.out.stem + "_logs")   # the servers' logs: the planner's decisions
    logs.mkdir(parents=True, exist_ok=True)
    for name in args.configs.split(","):
        results[name] = run_config(name, args, trace, logs)
        print_result(name, results[name])
    print(f"server logs: {logs}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                   indent=1))


if __name__ == "__main__":
    main()
