"""Resident memory of each worker of `splitserve serve` beside the KV pool it planned.

    python bench/worker_memory.py [--serve-arg=--kv-cache-memory=8GiB ...] [--settle 2] [--timeout 600]
                                  [--out bench/results/worker_memory.json]

Starts `python -m cluster.launch.cli serve --prefill 1 --decode 1 --http-port 0 --port 0` (the
default model: SmolLM2-135M-Instruct, or $SPLITSERVE_MODEL; `--serve-arg` adds any serve flag,
`--model` included), waits for its banner, reads the `KV cache:` lines (each role's pool as
planned), waits --settle seconds, then reads VmRSS and VmHWM (the peak) from /proc/<pid>/status of
the serve process and of its Ray worker processes (`ray::PrefillWorker`, `ray::DecodeWorker`, found
with pgrep -f and kept only when they descend from this serve process: another cluster's workers
on the machine are not counted). Prints one row per process and stops the server with SIGINT;
whatever of its workers outlives it is killed by pid. Linux only; standard library only.

The KV arena is zeroed at start, so its pages are resident: a worker's VmRSS is about its weights,
its KV pool and the runtime (torch, Ray) together. Compare a run at the default (4 GiB per engine on
CPU) with one at `--serve-arg=--kv-cache-memory=1GiB`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER_PATTERN = "ray::(Decode|Prefill)Worker"
KV_LINE = re.compile(r"KV cache: (?P<names>.+?) (?P<size>[\d.]+ [KMGT]?i?B) = (?P<blocks>[\d,]+) blocks .*; "
                     r"set by (?P<limit>.*)$")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument of `splitserve serve` (repeat it; write --serve-arg=--flag=value)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds between the banner and the reading")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the banner")
    p.add_argument("--out", type=Path, default=None, help="also write the figures here as JSON")
    return p.parse_args(argv)


# ---------------------------------------------------------------- /proc

def status_kib(pid: int, field: str) -> int | None:
    """A `kB` line of /proc/<pid>/status (VmRSS, VmHWM), or None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else None


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def descends_from(pid: int, root: int) -> bool:
    while pid and pid != 1:
        if pid == root:
            return True
        pid = parent_of(pid) or 0
    return False


def worker_pids(root: int) -> dict[int, str]:
    """This server's Ray workers: pid -> its process name (ray::PrefillWorker, ray::DecodeWorker)."""
    out = subprocess.run(["pgrep", "-f", WORKER_PATTERN], capture_output=True, text=True).stdout
    found = {}
    for pid in map(int, out.split()):
        if descends_from(pid, root):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            # ray::PrefillWorker, or while it runs a call ray::name:PrefillWorker.stats
            found[pid] = "ray::" + cmd[5:].split(":")[-1].split(".")[0] if cmd.startswith("ray::") else cmd
    return found


# ---------------------------------------------------------------- the server

def start_server(serve_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cluster.launch.cli", "serve", "--prefill", "1", "--decode", "1",
           "--http-port", "0", "--port", "0", *serve_args]
    print("starting:", " ".join(cmd[1:]), file=sys.stderr)
    return subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)


def read_banner(proc: subprocess.Popen, timeout: float) -> list[str]:
    """The server's stderr up to the banner's last line (the gRPC request to try)."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n" + "".join(lines[-40:]))
        lines.append(line)
        if "try: splitserve generate --server" in line:
            threading.Thread(target=proc.stderr.read, daemon=True).start()    # keep its pipe drained
            return lines
    raise TimeoutError(f"no banner within {timeout:.0f} s:\n" + "".join(lines[-40:]))


def planned_pools(banner: list[str]) -> dict[str, dict]:
    """Role -> its pool as the banner's `KV cache:` line says (GiB, blocks, what set it)."""
    pools = {}
    for line in banner:
        match = KV_LINE.search(line.rstrip())
        if match:
            for name in match["names"].split(", "):
                pools[name.split("-")[0]] = {"worker": name, "kv": match["size"],
                                             "blocks": int(match["blocks"].replace(",", "")), "limit": match["limit"]}
    return pools


def stop(proc: subprocess.Popen, workers: dict[int, str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in workers:            # what outlived its driver: only the pids this script found
        if status_kib(pid, "VmRSS") is not None:
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- the measurement

def measure(proc: subprocess.Popen, workers: dict[int, str], pools: dict[str, dict]) -> list[dict]:
    rows = [{"process": "driver (serve + router)", "pid": proc.pid, "role": None}]
    rows += [{"process": name, "pid": pid, "role": "prefill" if "Prefill" in name else "decode"}
             for pid, name in sorted(workers.items())]
    for row in rows:
        row["vm_rss_mib"] = (status_kib(row["pid"], "VmRSS") or 0) / 1024
        row["vm_hwm_mib"] = (status_kib(row["pid"], "VmHWM") or 0) / 1024
        row["planned_kv"] = pools.get(row["role"]) if row["role"] else None
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'process':<26}{'pid':>8}{'VmRSS MiB':>12}{'VmHWM MiB':>12}  planned KV")
    for r in rows:
        kv = r["planned_kv"]
        planned = f"{kv['kv']} ({kv['worker']}, {kv['blocks']:,} blocks; set by {kv['limit']})" if kv else ""
        print(f"{r['process']:<26}{r['pid']:>8}{r['vm_rss_mib']:>12.0f}{r['vm_hwm_mib']:>12.0f}  {planned}")


def main(argv=None) -> int:
    args = parse_args(argv)
    proc = start_server(args.serve_arg)
    workers: dict[int, str] = {}
    try:
        banner = read_banner(proc, args.timeout)
        print("".join(line for line in banner if "KV cache:" in line or "serving" in line), end="", file=sys.stderr)
        time.sleep(args.settle)
        workers = worker_pids(proc.pid)
        if not workers:
            raise RuntimeError(f"no {WORKER_PATTERN} process descends from the server (pid {proc.pid})")
        rows = measure(proc, workers, planned_pools(banner))
    finally:
        stop(proc, workers)
    print_rows(rows)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"serve_args": args.serve_arg, "processes": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
