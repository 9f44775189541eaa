"""A new user's first answer: `splitserve serve --request QUESTION` from an empty cache (cold: the
GGUF conversion, the C ops' build and the kernel measurement run) and again (warm), timed from the
command's start to its first answer byte and to its exit, with the longest silence on its stderr
(the status line prints a line per phase and one every few seconds on a pipe).

    PYTHONPATH=. python bench/first_answer.py [--runs 1] [--warm-only] [-- extra serve flags]

Cold runs use a fresh SPLITSERVE_CACHE_DIR (everything splitserve caches); warm ones reuse it.
With --phases it also runs one warm start with -v and prints where its time went (our log lines'
timestamps, relative to the start); --cold-phases runs the cold start itself with -v and prints its
phases. Each line ends with the load average before and after the run: on a shared machine a
figure taken under load is an upper bound. docs/first_run.md has the figures.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime

QUESTION = "What is the capital of France?"


def run_once(env: dict, extra: list[str], verbose: bool = False) -> dict:
    cmd = [sys.executable, "-m", "cluster.launch.cli", "serve", "--port", "0", "--http-port", "0",
           "--request", QUESTION, *(["-v"] if verbose else []), *extra]
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    err_times, err_lines, first = [start], [], {}

    def read_err():
        for line in proc.stderr:
            err_times.append(time.monotonic())
            err_lines.append((time.time(), line.decode(errors="replace").rstrip()))
    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out = b""
    while chunk := proc.stdout.read1(4096):
        first.setdefault("answer", time.monotonic())
        out += chunk
    proc.wait(600)
    reader.join(10)
    end = time.monotonic()
    gaps = [b - a for a, b in zip(err_times, [*err_times[1:], first.get("answer", end)])]
    return {"rc": proc.returncode, "first_byte_s": first.get("answer", end) - start, "total_s": end - start,
            "longest_silence_s": max(gaps), "answer": out.decode(errors="replace").strip(), "stderr": err_lines,
            "started_at": time.time() - (end - start), "load": (load_before, os.getloadavg()[0])}


def phases(result: dict) -> None:
    """Our log lines' own timestamps, relative to the command's start."""
    stamp = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ ([\w.]+): (.*)")
    for _, line in result["stderr"]:
        m = stamp.match(line)
        if m:
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - result["started_at"]
            print(f"  {at:6.1f} s  {m.group(2)}: {m.group(3)[:110]}")


def report(label: str, r: dict) -> None:
    print(f"{label:6s} rc {r['rc']}  first answer byte {r['first_byte_s']:5.1f} s  exit {r['total_s']:5.1f} s  "
          f"longest stderr silence {r['longest_silence_s']:4.1f} s  load average {r['load'][0]:.1f} -> "
          f"{r['load'][1]:.1f}  answer: {r['answer'][:60]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="warm runs after the cold one")
    ap.add_argument("--warm-only", action="store_true", help="use the existing cache (no cold run)")
    ap.add_argument("--phases", action="store_true", help="also one warm run with -v: where the time went")
    ap.add_argument("--cold-phases", action="store_true", help="the cold run with -v, and where its time went")
    ap.add_argument("extra", nargs="*", help="more serve flags (after --)")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_MODEL"}
    with tempfile.TemporaryDirectory(prefix="splitserve-cold-") as cache:
        if not args.warm_only:
            env["SPLITSERVE_CACHE_DIR"] = cache
            cold = run_once(env, args.extra, verbose=args.cold_phases)
            report("cold -v" if args.cold_phases else "cold", cold)
            if args.cold_phases:
                phases(cold)
            if cold["rc"]:
                print("\n".join(line for _, line in cold["stderr"][-20:]))
        for _ in range(args.runs):
            report("warm", run_once(env, args.extra))
        if args.phases:
            verbose = run_once(env, args.extra, verbose=True)
            report("warm -v", verbose)
            phases(verbose)


if __name__ == "__main__":
    main()
