"""Chaos benchmark: does the served cluster keep its promises while its workers are SIGKILLed?

    python bench/chaos.py [--topology 1p1d|2p2d] [--requests 2000] [--concurrency 16]
                          [--kill-every 4] [--duration 900] [--no-faults] [--out FILE]
    python bench/chaos.py --requests 60 --concurrency 8 --kill-every 3 --duration 60   # smoke run

It starts a real cluster in this process (Ray actors, gRPC and NIXL on 127.0.0.1; the router runs
here), builds a workload from --seed up front and runs it twice through bench/chaos_load.py, a
separate process: once without faults (the reference, and latency without faults), then once while
a random live worker is SIGKILLed every --kill-every seconds (Ray restarts it: max_restarts=-1).

Every request has an outcome class fixed up front: bad input (out-of-vocab id, max_tokens over the
limit, empty or over-long prompt, top_p 0, unknown speculative method) must get INVALID_ARGUMENT;
a short deadline may get DEADLINE_EXCEEDED (or complete); a client cancel after k tokens may get
CANCELLED (or complete); everything else must complete (with max_tokens tokens if it ends on
length). Anything else is a failure, counted by status code. The tokens of every request are
compared with the reference run's (the whole stream where both completed, the common prefix
otherwise); greedy and seeded sampling alike must match in float32.

After each run it waits until the cluster is idle and reads every worker's blocks in use and
leases, and it records the resident memory (VmRSS) of the driver and of every worker process at
the start and end of each run. It prints a summary and a one-line verdict against the goals
(100% of requests that must complete do, 0 mismatches in float32, 0 blocks in use once idle, RSS
growth under 10% for every process that lived through a run) and writes it all to --out as JSON.
See docs/reliability.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOPOLOGIES = {"1p1d": (1, 1), "2p2d": (2, 2)}
BAD_KINDS = ("oov_token", "max_tokens_over_limit", "empty_prompt", "prompt_too_long", "top_p_zero",
             "unknown_speculative")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--topology", choices=sorted(TOPOLOGIES), default="1p1d", help="prefill and decode workers")
    ap.add_argument("--model", default=None, help="model directory (default: EngineConfig()'s built-in model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                    help="engine dtype; token equality with the reference run is a goal in float32 only")
    ap.add_argument("--requests", type=int, default=2000, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    ap.add_argument("--duration", type=float, default=900.0,
                    help="seconds per run after which no request is started")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds after --duration (without kills) before running requests are cut (UNFINISHED)")
    ap.add_argument("--kill-every", type=float, default=4.0, help="seconds between SIGKILLs of a random worker")
    ap.add_argument("--no-faults", action="store_true", help="run the workload once, fault-free, and no kills")
    ap.add_argument("--seed", type=int, default=0, help="seeds the workload and the choice of victims")
    ap.add_argument("--tokens-min", type=int, default=4, help="fewest new tokens a request asks for")
    ap.add_argument("--tokens-max", type=int, default=48, help="most new tokens a request asks for")
    ap.add_argument("--max-prompt", type=int, default=1024, help="longest valid prompt, in tokens")
    ap.add_argument("--max-tokens-limit", type=int, default=64, help="the server's max_tokens limit")
    ap.add_argument("--cancel-share", type=float, default=0.10, help="share of requests the client cancels")
    ap.add_argument("--deadline-share", type=float, default=0.05, help="share of requests with a short deadline")
    ap.add_argument("--deadline-s", type=float, default=0.05, help="the short deadline, seconds")
    ap.add_argument("--bad-share", type=float, default=0.05, help="share of bad inputs (INVALID_ARGUMENT)")
    ap.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per worker")
    ap.add_argument("--idle-timeout", type=float, default=90.0,
                    help="seconds to wait after a run for every worker to answer and be idle")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


# --- the workload -----------------------------------------------------------------------------
def make_workload(args, vocab: int, max_model_len: int) -> list[dict]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]
    prefixes = [ids(rng.randint(256, min(512, args.max_prompt - 64))) for _ in range(4)]
    out, n_bad = [], 0
    for i in range(args.requests):
        u = rng.random()
        kind = ("bad" if u < args.bad_share else "deadline" if u < args.bad_share + args.deadline_share
                else "cancel" if u < args.bad_share + args.deadline_share + args.cancel_share else "normal")
        shape = rng.random()
        if kind == "deadline":                    # long prompt, many tokens, tiny deadline: cannot finish
            prompt = ids(rng.randint(args.max_prompt // 2, args.max_prompt))
        elif shape < 0.40:
            prompt = ids(rng.randint(1, 32))      # short: prefilled on the decode worker
        elif shape < 0.75:
            prompt = ids(rng.randint(33, 256))
        elif shape < 0.85:
            prompt = ids(rng.randint(257, args.max_prompt))
        else:                                      # a shared long prefix and a short suffix of its own
            prompt = rng.choice(prefixes) + ids(rng.randint(1, 64))
        max_tokens = args.tokens_max if kind == "deadline" else rng.randint(args.tokens_min, args.tokens_max)
        sampling = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.75}
        if rng.random() < 0.5:
            sampling.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
        req = {"i": i, "kind": kind, "prompt": prompt, "sampling": sampling, "timeout": 300.0}
        if kind == "cancel":
            sampling["max_tokens"] = max(max_tokens, 8)
            req["cancel_after"] = rng.randint(1, sampling["max_tokens"] - 2)
        elif kind == "deadline":
            req["timeout"] = args.deadline_s
        elif kind == "bad":
            req["bad"] = bad = BAD_KINDS[n_bad % len(BAD_KINDS)]
            n_bad += 1
            if bad == "oov_token":
                prompt[rng.randrange(len(prompt))] = vocab + rng.randrange(1000)
            elif bad == "max_tokens_over_limit":
                sampling["max_tokens"] = args.max_tokens_limit + 1 + rng.randrange(1000)
            elif bad == "empty_prompt":
                req["prompt"], req["empty_prompt"] = [], True
            elif bad == "prompt_too_long":
                req["prompt"] = ids(max_model_len)
            elif bad == "top_p_zero":
                sampling.update(temperature=0.8, top_p=0.0)
            else:
                sampling["speculative"] = "no-such-method"
        out.append(req)
    return out


# --- the cluster on a background event loop (the pattern of tests/e2e/cluster_harness.py) ------
class ClusterThread:
    def __init__(self, cfg):
        from cluster.launch.app import start_cluster
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cluster = self.run(start_cluster(cfg), timeout=300)
        self.target = f"127.0.0.1:{self.cluster.port}"

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self, timeout: float = 3.0) -> dict:
        """name -> the worker's stats, or None when it does not answer in time (dead, restarting)."""
        async def one(client):
            try:
                return await asyncio.wait_for(client.stats(), timeout)
            except Exception:  # noqa: BLE001
                return None

        async def go():
            names = list(self.cluster.workers)
            return dict(zip(names, await asyncio.gather(*(one(self.cluster.workers[n]) for n in names))))
        return self.run(go(), timeout=timeout + 30)

    def stop(self):
        try:
            self.run(self.cluster.stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def rss_kb(pid: int | None) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def rss_snapshot(ct: ClusterThread) -> dict:
    procs = {"driver": os.getpid()} | {n: s.pid if s is not None else None for n, s in ct.stats().items()}
    return {name: {"pid": pid, "rss_kb": rss_kb(pid)} for name, pid in procs.items()}


def rss_growth(start: dict, end: dict) -> dict:
    out = {}
    for name, s in start.items():
        e = end.get(name, {})
        same = s["pid"] is not None and s["pid"] == e.get("pid") and s["rss_kb"] and e.get("rss_kb")
        out[name] = {"start": s, "end": e, "restarted": s["pid"] != e.get("pid"),
                     "growth_pct": round(100.0 * (e["rss_kb"] - s["rss_kb"]) / s["rss_kb"], 2) if same else None}
    return out


def wait_idle(ct: ClusterThread, timeout: float) -> dict:
    """Every worker answering with nothing held, queued or leased; else the last view at timeout."""
    limit = time.monotonic() + timeout
    while True:
        stats = ct.stats()
        keys = ("pid", "blocks_used", "leases", "running", "waiting")
        view = {n: None if s is None else {k: getattr(s, k) for k in keys} for n, s in stats.items()}
        idle = all(v is not None and not (v["blocks_used"] or v["leases"] or v["running"] or v["waiting"])
                   for v in view.values())
        if idle or time.monotonic() > limit:
            return {"idle": idle, "workers": view}
        time.sleep(0.25)


# --- one run ----------------------------------------------------------------------------------
def run_load(ct, args, workload, run: str, faults: bool, tmp: Path, duration=None) -> tuple[dict, list]:
    duration = args.duration if duration is None else duration
    spec = {"target": ct.target, "concurrency": args.concurrency, "duration": duration,
            "grace": args.grace, "run": run, "requests": workload}
    spec_path, out_path = tmp / f"{run}-spec.json", tmp / f"{run}-out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "chaos_load.py"), str(spec_path), str(out_path)])
    rng, kills = random.Random(args.seed + 1), []
    t0 = time.monotonic()
    try:
        next_kill = t0 + args.kill_every
        while proc.poll() is None:
            time.sleep(0.1)
            if not faults or time.monotonic() < next_kill or time.monotonic() > t0 + duration:
                continue                           # the grace period after --duration is fault-free
            next_kill += args.kill_every
            live = {n: s.pid for n, s in ct.stats().items() if s is not None}
            if live and proc.poll() is None:
                name = rng.choice(sorted(live))
                try:
                    os.kill(live[name], signal.SIGKILL)
                    kills.append({"t": round(time.monotonic() - t0, 2), "worker": name, "pid": live[name]})
                    print(f"  [{kills[-1]['t']:7.1f} s] SIGKILL {name} (pid {live[name]})", file=sys.stderr)
                except ProcessLookupError:
                    pass
        proc.wait(duration + args.grace + 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"load generator exited with {proc.returncode}")
    return json.loads(out_path.read_text()), kills


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else None


def classify(workload: list[dict], load: dict) -> dict:
    """Outcomes per class; failures by code, with a few examples."""
    by_i = {r["i"]: r for r in workload}
    counts, failed, examples = Counter(), Counter(), []
    for res in load["results"]:
        req, code = by_i[res["i"]], res["code"]
        counts["sent"] += 1
        counts[f"sent_{req['kind']}"] += 1
        if code == "OK" and res["finish_reason"] == "length" and len(res["tokens"]) != req["sampling"]["max_tokens"]:
            code = "WRONG_LENGTH"                 # a token lost or repeated
        elif code == "OK" and res["finish_reason"] == "abort":
            code = "ABORTED"
        ok = {"bad": {"INVALID_ARGUMENT": "invalid_argument"},
              "deadline": {"DEADLINE_EXCEEDED": "deadline_exceeded", "OK": "completed"},
              "cancel": {"CANCELLED": "cancelled", "OK": "completed"},
              "normal": {"OK": "completed"}}[req["kind"]]
        if req["kind"] == "bad" and code == "OK":
            code = "OK_ON_BAD_INPUT"
        if code in ok:
            counts[ok[code]] += 1
            if req["kind"] == "normal":
                counts["completed_required"] += 1
        else:
            failed[code] += 1
            if failed[code] <= 3:                 # the first three of each code
                examples.append({"i": res["i"], "kind": req["kind"], "bad": req.get("bad"), "code": code,
                                 "details": res["details"], "tokens": len(res["tokens"])})
    e2e = [r["e2e"] for r in load["results"] if r["e2e"] is not None and by_i[r["i"]]["kind"] == "normal"]
    ttft = [r["ttft"] for r in load["results"] if r["ttft"] is not None and by_i[r["i"]]["kind"] == "normal"]
    required = counts["sent_normal"]
    return {**{k: counts[k] for k in ("sent", "completed", "cancelled", "deadline_exceeded", "invalid_argument")},
            "not_sent": load["not_sent"], "failed": dict(failed), "failed_total": sum(failed.values()),
            "failure_examples": examples, "must_complete": required,
            "completion_pct": round(100.0 * counts["completed_required"] / required, 3) if required else None,
            "latency_s": {"e2e_p50": pct(e2e, .5), "e2e_p99": pct(e2e, .99),
                          "ttft_p50": pct(ttft, .5), "ttft_p99": pct(ttft, .99)},
            "load_cpu_s": round(load["cpu_s"], 2), "wall_s": round(load["wall_s"], 2)}


def compare(workload: list[dict], ref: dict, run: dict) -> dict:
    kinds = {r["i"]: r["kind"] for r in workload}
    a = {r["i"]: r for r in ref["results"]}
    compared = tokens = 0
    mismatches = []
    for r in run["results"]:
        x = a.get(r["i"])
        if x is None or kinds[r["i"]] == "bad" or not x["tokens"] or not r["tokens"]:
            continue
        full = x["code"] == r["code"] == "OK"
        n = len(x["tokens"]) if full else min(len(x["tokens"]), len(r["tokens"]))
        compared += 1
        tokens += n
        if x["tokens"][:n] != r["tokens"][:n] or (full and len(x["tokens"]) != len(r["tokens"])):
            at = next((k for k in range(n) if x["tokens"][k] != r["tokens"][k]), n)
            mismatches.append({"i": r["i"], "kind": kinds[r["i"]], "first_difference_at": at,
                               "ref_len": len(x["tokens"]), "run_len": len(r["tokens"])})
    return {"requests_compared": compared, "tokens_compared": tokens, "mismatches": len(mismatches),
            "mismatch_examples": mismatches[:8]}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def verdict(report: dict, dtype: str) -> str:
    runs = report["runs"]
    completion = min((r["completion_pct"] for r in runs if r["completion_pct"] is not None), default=None)
    failed = sum(r["failed_total"] for r in runs)
    blocks = [w.get("blocks_used") if w else None for r in runs for w in r["idle"]["workers"].values()]
    blocks_ok = all(b == 0 for b in blocks)
    growth = [p["growth_pct"] for r in runs for p in r["rss"].values() if p["growth_pct"] is not None]
    mism = report["comparison"]["mismatches"] if report.get("comparison") else 0
    checks = {"completion": completion == 100.0 and failed == 0,
              "mismatches": mism == 0 or dtype != "float32", "blocks": blocks_ok,
              "memory": bool(growth) and max(growth) < 10.0}
    worst = f"{max(growth):.1f}%" if growth else "n/a"
    mism_s = f"{mism}" + ("" if dtype == "float32" else f" (not a goal in {dtype})")
    sent = "; ".join(f"{r['name']} sent {r['sent']}/{r['sent'] + r['not_sent']}" for r in runs)
    return (f"VERDICT {'PASS' if all(checks.values()) else 'FAIL'} ({sent}): completion {completion}% "
            f"({failed} failed) [goal 100%, 0 failed]; mismatches {mism_s} [goal 0]; blocks in use once idle "
            f"{'0' if blocks_ok else blocks} [goal 0]; worst RSS growth {worst} [goal <10%]")


def print_report(report: dict) -> None:
    for r in report["runs"]:
        lat = r["latency_s"]
        print(f"== {r['name']} run ({'with' if r['faults'] else 'no'} faults): sent {r['sent']}, completed "
              f"{r['completed']}, cancelled {r['cancelled']}, deadline-exceeded {r['deadline_exceeded']}, "
              f"invalid-argument {r['invalid_argument']} (expected), failed {r['failed_total']} {r['failed']}, "
              f"not sent {r['not_sent']}")
        print(f"   completion of must-complete requests {r['completion_pct']}% of {r['must_complete']}; "
              f"e2e p50/p99 {lat['e2e_p50']}/{lat['e2e_p99']} s, ttft p50/p99 {lat['ttft_p50']}/{lat['ttft_p99']} s; "
              f"wall {r['wall_s']} s; load generator CPU {r['load_cpu_s']} s; kills {len(r['kills'])}; "
              f"router recoveries {r['router_recoveries']}")
        for ex in r["failure_examples"][:6]:
            print(f"   failure: {ex}")
        print(f"   idle: {r['idle']['idle']}; workers: {r['idle']['workers']}")
        for name, p in r["rss"].items():
            g = "restarted" if p["restarted"] else f"{p['growth_pct']}%"
            print(f"   rss {name:>10}: {p['start']['rss_kb']} -> {p['end'].get('rss_kb')} kB ({g})")
    c = report.get("comparison")
    if c:
        print(f"== tokens: {c['tokens_compared']} compared over {c['requests_compared']} requests, "
              f"{c['mismatches']} mismatched requests {c['mismatch_examples'][:4]}")
    print(report["verdict"])


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from cluster.launch.app import ClusterConfig
    from cluster.config import DataPlaneConfig
    from cluster.config import CacheConfig, EngineConfig
    from cluster.model.model_config import load_model_config
    engine = EngineConfig(dtype=args.dtype, cache=CacheConfig(num_blocks=args.kv_blocks),
                          **({"model": Path(args.model)} if args.model else {}))
    mc = load_model_config(engine.model)
    workload = make_workload(args, mc.vocab_size, engine.max_model_len or mc.max_position_embeddings)
    num_prefill, num_decode = TOPOLOGIES[args.topology]
    cfg = ClusterConfig(http_port=None, engine=engine, num_prefill=num_prefill, num_decode=num_decode,
                        data_plane=DataPlaneConfig(transport="nixl"), port=0,
                        max_tokens_limit=args.max_tokens_limit)
    report = {"command": " ".join([sys.executable, *sys.argv]), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
              "model": str(engine.model), "dtype": args.dtype, "topology": args.topology,
              "args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    t = time.monotonic()
    ct = ClusterThread(cfg)
    print(f"cluster {args.topology} up in {time.monotonic() - t:.1f} s at {ct.target}; "
          f"{args.requests} requests per run", file=sys.stderr)
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            warm = [dict(r, kind="normal") for r in make_workload(
                argparse.Namespace(**{**vars(args), "seed": args.seed + 99, "requests": 2 * args.concurrency,
                                      "bad_share": 0, "deadline_share": 0, "cancel_share": 0}),
                mc.vocab_size, mc.max_position_embeddings)]
            warm_out = classify(warm, run_load(ct, args, warm, "warmup", False, Path(tmp), 60.0)[0])
            if warm_out["failed_total"]:               # not serving before any fault: no point going on
                report["aborted"] = (f"warm-up failed before any fault: {warm_out['failed']} "
                                     f"{warm_out['failure_examples'][:2]}")
            wait_idle(ct, args.idle_timeout)
            runs = [("reference", False)] + ([] if args.no_faults else [("faults", True)])
            for name, faults in [] if report.get("aborted") else runs:
                recoveries0 = ct.cluster.router.recoveries
                start = rss_snapshot(ct)
                load, kills = run_load(ct, args, workload, name, faults, Path(tmp))
                idle = wait_idle(ct, args.idle_timeout)
                results[name] = load
                report["runs"].append({"name": name, "faults": faults, **classify(workload, load), "kills": kills,
                                       "router_recoveries": ct.cluster.router.recoveries - recoveries0,
                                       "idle": idle, "rss": rss_growth(start, rss_snapshot(ct))})
    finally:
        ct.stop()
    if "faults" in results:
        report["comparison"] = compare(workload, results["reference"], results["faults"])
    report["verdict"] = (f"VERDICT FAIL: {report['aborted']}" if report.get("aborted")
                         else verdict(report, args.dtype))
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if report["verdict"].startswith("VERDICT PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
