"""Idle CPU of a whole cluster: every process of `splitserve serve`, Ray's own included.

    python bench/idle_cpu.py [--mode colocated pd-nixl pd-tcp] [--window 10] [--settle 3] [--goal 2.0]
                             [--env RAY_X=1 ...] [--serve-arg=--prefill=3 ...] [--stacks] [--hold S]
                             [--out bench/results/idle_cpu.json]

For each mode it starts `python -m cluster.launch.cli serve` (colocated: `--colocated`; pd-nixl / pd-tcp:
`--prefill 1 --decode 1 --transport nixl|tcp`) on a free port, waits until the gRPC health check
says SERVING, sends one request (`def f(x):`, 8 tokens) so every worker is warm, waits --settle
seconds, then reads utime+stime from /proc/<pid>/stat (and /proc/<pid>/task/*/stat) of the serve
process and all its descendants at the start and the end of a --window second window. On a local
cluster every Ray process (gcs_server, raylet, dashboard, log monitor, autoscaler monitor, the
dashboard and runtime-env agents, worker and prestarted idle worker processes) is a descendant of
the driver; any process naming the Ray session in its command line that is not one is reported
as a "stray".

It prints, per process, % of one core, wake-ups per second (context switches: an idle timer
every 10 ms is 100/s) and a verdict against --goal (the project's goal: an idle cluster uses under
2% of a core in every one of its processes); for each process over the goal, its busiest threads.
Thread names come from /proc/<pid>/task/<tid>/comm; threads started before Ray renames a worker
process (Python threads, UCX's progress thread) inherit `ray::IDLE`, so --stacks adds each busy
thread's innermost frames (gdb). --hold keeps the cluster up after measuring, to inspect it.
The server is stopped with SIGINT; whatever of its tree outlives it is killed by pid.

--env KEY=VALUE sets environment variables of the serve process: Ray's C++ processes read
`RAY_<name>` for every entry of ray_config_def.h (the `_system_config` keys), and children inherit
it. Figures move with the machine's load: compare runs taken back to back. Exit status 1 when a
process is over the goal. Linux only; standard library only (plus the repository's gRPC client).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CLK_TCK = os.sysconf("SC_CLK_TCK")
MODES = {"colocated": ["--colocated"],
         "pd-nixl": ["--prefill", "1", "--decode", "1", "--transport", "nixl"],
         "pd-tcp": ["--prefill", "1", "--decode", "1", "--transport", "tcp"]}


# ---------------------------------------------------------------- /proc readers

def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def stat_fields(path: str) -> list[str] | None:
    """Fields of a /proc stat file after the `(comm)` field: [state, ppid, ...]."""
    text = _read(path)
    return text[text.rindex(")") + 2:].split() if text else None


def cpu_ticks(path: str) -> int | None:
    f = stat_fields(path)
    return int(f[11]) + int(f[12]) if f else None     # utime, stime (fields 14, 15 of stat)


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = stat_fields(f"/proc/{entry}/stat")
            if f:
                kids.setdefault(int(f[1]), []).append(int(entry))
    return kids


def descendants(root: int) -> list[int]:
    kids, out, todo = children_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return sorted(out)


def start_time(pid: int) -> str | None:
    f = stat_fields(f"/proc/{pid}/stat")
    return f[19] if f else None                       # starttime (field 22): tells a reused pid apart


def cmdline(pid: int) -> str:
    return (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()


def proc_name(pid: int, root: int) -> str:
    """A short, recognisable name: ray::PrefillWorker, raylet, gcs_server, log_monitor, ..."""
    args = cmdline(pid).split()
    if pid == root:
        return "driver (serve + router)"
    if not args:
        return (_read(f"/proc/{pid}/comm") or "?").strip()
    if args[0].startswith("ray::"):        # ray::PrefillWorker, or while it runs a task: ray::name:PrefillWorker.stats
        return "ray::" + args[0][5:].split(":")[-1].split(".")[0]
    if Path(args[0]).name.startswith("python"):          # python [-u] path/to/script.py ...
        script = next((a for a in args[1:] if not a.startswith("-")), "")
        if script.endswith("autoscaler/_private/monitor.py"):
            return "autoscaler_monitor"
        return Path(script).stem or "python"
    return Path(args[0]).name


def switches(path: str) -> int:
    """Context switches of a thread so far: an idle thread's wake-ups (a timer every 5 ms: 200/s)."""
    text = _read(path) or ""
    return sum(int(line.split()[1]) for line in text.splitlines() if "ctxt_switches:" in line)


def threads(pid: int) -> dict[int, tuple[str, int, int]]:
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        t = cpu_ticks(f"/proc/{pid}/task/{tid}/stat")
        if t is not None:
            out[int(tid)] = ((_read(f"/proc/{pid}/task/{tid}/comm") or "?").strip(), t,
                             switches(f"/proc/{pid}/task/{tid}/status"))
    return out


def snapshot(pids) -> dict[int, dict]:
    snap = {}
    for pid in pids:
        t = cpu_ticks(f"/proc/{pid}/stat")
        if t is not None:
            snap[pid] = {"ticks": t, "threads": threads(pid)}
    return snap


# ---------------------------------------------------------------- the measurement

def measure(root: int, window: float, goal: float) -> dict:
    before_pids = descendants(root)
    t0 = time.monotonic()
    before = snapshot(before_pids)
    time.sleep(window)
    after_pids = descendants(root)
    after = snapshot(after_pids)
    wall = time.monotonic() - t0
    rows = []
    for pid in after_pids:
        if pid not in after:
            continue
        start = before.get(pid, {"ticks": 0, "threads": {}})   # born in the window: all its time counts
        pct = 100.0 * (after[pid]["ticks"] - start["ticks"]) / CLK_TCK / wall
        th = []
        for tid, (name, ticks, sw) in after[pid]["threads"].items():
            _, t0_ticks, t0_sw = start["threads"].get(tid, (name, 0, 0))
            if ticks > t0_ticks or sw > t0_sw:
                th.append({"tid": tid, "name": name, "cpu_pct": round(100.0 * (ticks - t0_ticks) / CLK_TCK / wall, 2),
                           "wakeups_per_s": round((sw - t0_sw) / wall, 1)})
        th.sort(key=lambda r: (-r["cpu_pct"], -r["wakeups_per_s"]))
        rows.append({"pid": pid, "ppid": int(stat_fields(f"/proc/{pid}/stat")[1]), "name": proc_name(pid, root),
                     "cmdline": cmdline(pid)[:300], "cpu_pct": round(pct, 2),
                     "wakeups_per_s": round(sum(t["wakeups_per_s"] for t in th), 1), "new_in_window": pid not in before,
                     "num_threads": len(after[pid]["threads"]),
                     "verdict": "OK" if pct < goal else "OVER", "threads": th})
    gone = [{"pid": p, "name": proc_name(p, root)} for p in before if p not in after]
    return {"wall_s": round(wall, 3), "processes": rows, "exited_in_window": gone,
            "total_cpu_pct": round(sum(r["cpu_pct"] for r in rows), 2),
            "over_goal": [r["name"] for r in rows if r["verdict"] == "OVER"], "strays": strays(root, after_pids)}


def strays(root: int, tree: list[int]) -> list[dict]:
    """Processes of this Ray session that are not descendants of the serve process."""
    session = None
    for pid in tree:
        cmd = cmdline(pid)
        if "session_" in cmd:
            session = "session_" + cmd.split("session_", 1)[1].split("/")[0].split()[0]
            break
    if session is None:
        return []
    inside = set(tree)
    return [{"pid": int(p), "cmdline": cmdline(int(p))[:200]} for p in os.listdir("/proc")
            if p.isdigit() and int(p) not in inside and session in cmdline(int(p))]


# ---------------------------------------------------------------- the server's life cycle

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(proc: subprocess.Popen, target: str, timeout: float) -> None:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{target} not SERVING after {timeout}s")


def warm_up(target: str) -> str:
    from router.client import Client  # noqa: PLC0415
    client = Client(target)
    try:
        return client.generate("def f(x):", max_tokens=8, timeout=120).text
    finally:
        client.close()


def stop(proc: subprocess.Popen, tree: dict[int, str | None]) -> None:
    tree = tree or {pid: start_time(pid) for pid in descendants(proc.pid)}
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    time.sleep(1)
    for pid, started in tree.items():     # only what this run started, by pid (and start time)
        if pid != proc.pid and started is not None and start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def run_mode(mode: str, args) -> dict:
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(dict(kv.split("=", 1) for kv in args.env))
    cmd = [sys.executable, "-m", "cluster.launch.cli", "serve", *MODES[mode], "--port", str(port), "--http-port", "0",
           *args.serve_arg]
    log_path = Path(args.out).with_name(f"idle_cpu_{mode}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n== {mode}: {' '.join(cmd[1:])}" + (f"  env: {' '.join(args.env)}" if args.env else ""), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    tree: dict[int, str | None] = {}
    try:
        wait_serving(proc, target, args.startup_timeout)
        text = warm_up(target)
        time.sleep(args.settle)
        tree = {pid: start_time(pid) for pid in descendants(proc.pid)}
        result = measure(proc.pid, args.window, args.goal)
        tree.update({r["pid"]: start_time(r["pid"]) for r in result["processes"] if r["pid"] not in tree})
        if args.stacks:
            add_stacks(result, args.goal)
        if args.hold:
            print_table(result, args.goal, args.top_threads)
            print(f"holding the cluster {args.hold:.0f} s for inspection (serve pid {proc.pid}, {target})", flush=True)
            time.sleep(args.hold)
    finally:
        stop(proc, tree)
    result.update(mode=mode, command=cmd[1:], env=args.env, warm_up_text=text, window_s=args.window,
                  settle_s=args.settle, goal_pct=args.goal, serve_returncode=proc.returncode)
    return result


def _function(frame: str) -> str:
    """'#1  0x7f.. in ucp_worker_progress () from lib' or '#0  syscall () at f.S:38' -> the function's name."""
    text = frame.split(" in ", 1)[1] if " in " in frame else frame.split(maxsplit=1)[1]
    return text.split(" (")[0].split("(")[0]


def add_stacks(res: dict, goal: float) -> None:
    """With gdb: the innermost frames of each busy thread (>= goal/4) of each process over the goal.
    Thread names alone do not tell: threads started before Ray renames a worker inherit `ray::IDLE`."""
    for r in res["processes"]:
        hot = {t["tid"]: t for t in r["threads"] if t["cpu_pct"] >= goal / 4}
        if r["cpu_pct"] < goal or not hot:
            continue
        out = subprocess.run(["gdb", "-batch", "-p", str(r["pid"]), "-ex", "set pagination off",
                              "-ex", "thread apply all bt 12"], capture_output=True, text=True, timeout=120).stdout
        for block in out.split("\nThread ")[1:]:
            lwp = int(block.split("(LWP ", 1)[1].split(")", 1)[0]) if "(LWP " in block else None
            if lwp in hot:
                frames = [_function(line) for line in block.splitlines() if line.startswith("#")]
                hot[lwp]["stack"] = frames


def print_table(res: dict, goal: float, top_threads: int) -> None:
    print(f"{'pid':>7}  {'process':<28} {'% core':>7} {'wakeups/s':>9}  verdict   (window {res['wall_s']:.1f} s)")
    for r in sorted(res["processes"], key=lambda r: -r["cpu_pct"]):
        print(f"{r['pid']:>7}  {r['name'][:28]:<28} {r['cpu_pct']:>7.2f} {r['wakeups_per_s']:>9.1f}  {r['verdict']}")
        if r["cpu_pct"] >= goal:
            for t in r["threads"][:top_threads]:
                print(f"{'':>9}   thread {t['tid']:>7} {t['name'][:16]:<16} "
                      f"{t['cpu_pct']:>7.2f} {t['wakeups_per_s']:>9.1f}")
                if t.get("stack"):
                    frames = t["stack"][:1] + [f for f in t["stack"][1:] if not f.startswith(("_", "do_futex"))][:4]
                    print(f"{'':>21}{' < '.join(f[:48] for f in frames)}")
    print(f"{'':>9}{'total':<28} {res['total_cpu_pct']:>7.2f}   over {goal}%: {', '.join(res['over_goal']) or 'none'}")
    if res["strays"]:
        print(f"  not descendants of serve (strays): {res['strays']}")
    if res["exited_in_window"]:
        print(f"  exited during the window: {res['exited_in_window']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--window", type=float, default=10.0, help="measurement window, seconds")
    p.add_argument("--settle", type=float, default=3.0, help="wait after the warm-up request, seconds")
    p.add_argument("--goal", type=float, default=2.0, help="%% of one core each process must stay under")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="env var of the serve process")
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument to `serve` (use --serve-arg=...)")
    p.add_argument("--top-threads", type=int, default=6, help="threads shown per process over the goal")
    p.add_argument("--hold", type=float, default=0.0, help="keep the cluster up this long after measuring (to inspect)")
    p.add_argument("--stacks", action="store_true",
                   help="show (gdb) the frames of busy threads of processes over --goal (pauses each a few s)")
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--out", default=str(ROOT / "bench/results/idle_cpu.json"))
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # run the `finally` that stops the server
    results = []
    for mode in args.mode:
        res = run_mode(mode, args)
        print_table(res, args.goal, args.top_threads)
        results.append(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"clk_tck": CLK_TCK, "cpus": os.cpu_count(), "runs": results}, indent=1))
    print(f"\nwrote {args.out}")
    return 1 if any(r["over_goal"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
