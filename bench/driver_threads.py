"""Where the `splitserve serve` driver's CPU goes under a steady load: per thread, and the Ray polls.

    python bench/driver_threads.py [--mode pd-http|colocated-http] [--concurrency 32] [--seconds 60]

Starts the cluster (bench/servers.py, the placement a user gets), loads it over the OpenAI HTTP
API with --concurrency streams of random 512-token prompts and 128 new tokens (greedy,
ignore_eos), waits --warmup seconds for the queues to fill, then reads over --seconds: the
driver's CPU per thread (/proc/<pid>/task/*/stat: the main thread runs the router and the HTTP
frontend; Ray's core-worker threads are named worker.io, client.poll0, ...), the streamed tokens,
and `splitserve_worker_stats_reports_total` by worker and source (poll: a Ray call; push: over
the token stream). --concurrency 0 measures the idle driver. docs/benchmarks.md has the figures.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))
from idle_cpu import CLK_TCK  # noqa: E402
from servers import SERVED_NAME, start_splitserve  # noqa: E402


def thread_ticks(pid: int) -> dict[tuple[str, str], int]:
    """(tid, thread name) -> utime + stime ticks."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[(tid, stat[stat.index("(") + 1:stat.rindex(")")])] = int(fields[11]) + int(fields[12])
    return out


def poll_counts(target: str) -> dict[str, float]:
    import requests
    text = requests.get(f"{target}/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("splitserve_worker_stats_reports_total")}


def load(target: str, stop: threading.Event, counted: list, seed: int) -> None:
    import requests
    rng, session = random.Random(seed), requests.Session()
    while not stop.is_set():
        body = {"model": SERVED_NAME, "prompt": [rng.randrange(100, 40000) for _ in range(512)], "max_tokens": 128,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with session.post(f"{target}/v1/completions", json=body, stream=True, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        counted.append(1)
        except requests.RequestException:
            if not stop.is_set():
                raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="pd-http", choices=("pd-http", "colocated-http"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=45.0)
    ap.add_argument("--log", type=Path, default=Path("/tmp/driver_threads.log"))
    args = ap.parse_args()
    from cluster.config import default_model_dir
    server = start_splitserve(args.mode, default_model_dir().resolve(), args.log, None)
    stop, counted = threading.Event(), []
    try:
        for i in range(args.concurrency):
            threading.Thread(target=load, args=(server.target, stop, counted, i), daemon=True).start()
        time.sleep(args.warmup if args.concurrency else 5.0)
        pid = server.proc.pid
        polls0, ticks0, tokens0, t0 = poll_counts(server.target), thread_ticks(pid), len(counted), time.time()
        time.sleep(args.seconds)
        polls1, ticks1, tokens1, wall = poll_counts(server.target), thread_ticks(pid), len(counted), time.time() - t0
    finally:
        stop.set()
        server.stop()
    report(args, wall, tokens1 - tokens0, ticks0, ticks1, polls0, polls1)


def report(args, wall: float, tokens: int, ticks0: dict, ticks1: dict, polls0: dict, polls1: dict) -> None:
    by_name: dict[str, float] = {}
    for key, ticks in ticks1.items():
        by_name[key[1]] = by_name.get(key[1], 0.0) + 1e3 * (ticks - ticks0.get(key, 0)) / CLK_TCK
    total = sum(by_name.values())
    per_token = (lambda ms: f"{1e3 * ms / tokens:8.0f} us/token") if tokens else (lambda ms: "")
    print(f"{args.mode}, {args.concurrency} streams: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s")
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1]):
        if ms:
            print(f"  {name:24s} {ms:8.0f} ms {per_token(ms)}")
    print(f"  driver total             {total:8.0f} ms = {total / wall:.1f} ms/s {per_token(total)}")
    for series in sorted(polls1):
        print(f"  {series} +{polls1[series] - polls0.get(series, 0):.0f}")


if __name__ == "__main__":
    main()
