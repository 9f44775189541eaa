"""Hostile clients beside a victim: each attack of [hardening] replayed against a served cluster
while a victim client sends short greedy requests, and the victim's latency under attack printed
beside its latency when quiet (one run, side by side: these machines are noisy).

    python bench/hostile.py [--model DIR] [--mode colocated-http|pd-http] [--seconds 8] [--out DIR]

The server is `splitserve serve` as a subprocess (bench/servers.py), with two tenants from a key
file: the attacker's and the victim's. Per attack: what the server answered the attacker (status
counts), the victim's median and p90 latency (a 32-token greedy completion over HTTP), their ratio
to quiet, and the worst `/health` latency seen meanwhile (the frontend's event loop: the goal is
under 100 ms). Attacks:

  stop_flood         completions with the most stop strings allowed (32 x 256 chars), 4 at once,
                     and the original 5,000 x 400 (2 MB), which is refused up front;
  stop_control       the same 4 completions without stop strings: the load alone, so that
                     stop_flood / stop_control is what the stop strings cost
  validation_flood   costly validation the bounds allow: 4 MB bodies of 64 prompts of random words
                     that tokenize past the context, and 4 MB chat conversations of 8,000
                     messages (rendered, then refused), 2 at once; the original 256 prompts x
                     n=64 and a 3.9 MB single prompt, refused up front
  malformed          the bodies that used to answer 500 (huge numbers, lone surrogates, deep JSON,
                     template argument collisions), in a loop
  slowloris          200 connections trickling header bytes, and 50 that send nothing (the phase
                     lasts until the server has closed them all, or 60 s)
  slot_hog           the attacker's tenant keeps 4 requests of n=16 samples in flight (the original
                     256-prompt request is refused up front); not an attack the bounds refuse but
                     load they admit: it shares the engine's batch with the victim, which only a
                     per-tenant cap (--max-in-flight-per-tenant) limits
`--phases slot_hog` runs only the named attacks (after quiet). Extra server flags go after `--`, e.g. `-- --max-in-flight-per-tenant 16`.
Writes hostile.json to --out.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import socket
import statistics
import string
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import SERVED_NAME, start_splitserve  # noqa: E402

ATTACKER, VICTIM = "sk-attacker-0123456789", "sk-victim-0123456789"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BIG = "1" + "0" * 400


def _post(addr, body, key: str, timeout: float = 120.0, path: str = "/v1/completions") -> int:
    conn = http.client.HTTPConnection(*addr, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data,
                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    except OSError:
        return 0
    finally:
        conn.close()


def _victim_body(i: int) -> dict:
    return {"model": SERVED_NAME, "prompt": f"def function_{i}(a, b):\n", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}


class Probe:
    """The victim's latencies and the worst /health latency while it runs."""

    def __init__(self, addr):
        self.addr, self.latencies, self.health_worst, self.stop = addr, [], 0.0, threading.Event()

    def victim(self) -> None:
        i = 0
        while not self.stop.is_set():
            t = time.perf_counter()
            status = _post(self.addr, _victim_body(i), VICTIM)
            if status == 200:
                self.latencies.append(time.perf_counter() - t)
            i += 1

    def health(self) -> None:
        conn = http.client.HTTPConnection(*self.addr, timeout=30)
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
            except OSError:
                conn = http.client.HTTPConnection(*self.addr, timeout=30)
                continue
            self.health_worst = max(self.health_worst, time.perf_counter() - t)
            time.sleep(0.02)


def _run_phase(addr, seconds: float, attackers: list) -> dict:
    probe = Probe(addr)
    statuses: Counter = Counter()
    stop = probe.stop

    def loop(fn):
        while not stop.is_set():
            statuses[fn()] += 1
    threads = [threading.Thread(target=probe.victim), threading.Thread(target=probe.health)]
    threads += [threading.Thread(target=loop, args=(fn,)) for fn in attackers]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(180)
    lat = sorted(probe.latencies)
    return {"victim_p50_s": statistics.median(lat) if lat else None,
            "victim_p90_s": lat[int(0.9 * (len(lat) - 1))] if lat else None, "victim_requests": len(lat),
            "health_worst_ms": round(probe.health_worst * 1e3, 1),
            "attacker_statuses": {str(k): v for k, v in sorted(statuses.items())}}


def _once(addr, body) -> int:
    return _post(addr, body, ATTACKER)


def _chat(addr, body) -> int:
    return _post(addr, body, ATTACKER, path="/v1/chat/completions")


def _attacks(addr) -> dict:
    stops = [f"{i:04d}" + "s" * 252 for i in range(32)]
    flood = {"model": SERVED_NAME, "prompt": "x", "max_tokens": 64, "ignore_eos": True, "stop": stops}
    control = {k: v for k, v in flood.items() if k != "stop"}
    original_stops = {"model": SERVED_NAME, "prompt": "x", "stop": ["s" * 400] * 5000}
    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(2, 9))) for _ in range(5000)]
    too_long = {"model": SERVED_NAME, "max_tokens": 1,      # 3.8 MB, each prompt past the context
                "prompt": [" ".join(rng.choice(words) for _ in range(10_000))[:60_000] for _ in range(64)]}
    chat = {"model": SERVED_NAME, "max_tokens": 1,
            "messages": [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(80))[:480]}] * 8000}
    samples = {"model": SERVED_NAME, "prompt": "def f():\n", "n": 16, "max_tokens": 16, "ignore_eos": True}
    malformed = [b'{"prompt": "x", "temperature": %s}' % BIG.encode(), b'{"prompt": "x", "top_k": 1099511627776}',
                 b'{"prompt": [2147483648]}', b'{"prompt": "\\ud800"}', b"[" * 10000 + b"]" * 10000,
                 b'{"messages": [], "chat_template_kwargs": {"messages": 1}}']
    counter = iter(range(10**9))
    return {
        "stop_flood": ([lambda: _once(addr, flood)] * 4,
                       lambda: {"original 5,000 x 400 stop strings": _once(addr, original_stops)}),
        "stop_control": ([lambda: _once(addr, control)] * 4, dict),
        "validation_flood": ([lambda: _once(addr, too_long), lambda: _chat(addr, chat)], lambda: {
            "original 256 prompts x n=64": _once(addr, {"prompt": ["y" * 900] * 256, "n": 64}),
            "3.9 MB text prompt": _once(addr, {"prompt": "def f(x):\n    return x\n" * 160_000})}),
        "malformed": ([lambda: _once(addr, malformed[next(counter) % len(malformed)])], dict),
        "slowloris": ([], dict),
        "slot_hog": ([lambda: _once(addr, samples)] * 4,
                     lambda: {"original 256-prompt request": _once(addr, {"prompt": ["z"] * 256, "max_tokens": 1})}),
    }


def _slowloris(addr, stop: threading.Event) -> dict:
    socks = []
    for i in range(250):
        s = socket.create_connection(addr)
        if i < 200:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    start, closed_at = time.monotonic(), {}
    while time.monotonic() - start < 60 and len(closed_at) < len(socks):
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                if i < 200:
                    s.send(b"X")
                s.settimeout(0.001)
                if s.recv(4096) == b"":
                    closed_at[i] = time.monotonic() - start
            except (socket.timeout, BlockingIOError):
                pass
            except OSError:
                closed_at[i] = time.monotonic() - start
        time.sleep(0.5)
    for s in socks:
        s.close()
    return {"connections": len(socks), "closed": len(closed_at),
            "closed_by_s": round(max(closed_at.values()), 1) if closed_at else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--mode", default="colocated-http", choices=["colocated-http", "pd-http"])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", default="bench-out/hostile")
    p.add_argument("--phases", default=None, help="comma-separated attacks to run (quiet always runs), e.g. slot_hog; "
                                                   "default: all")
    p.add_argument("server_args", nargs="*", help="more `splitserve serve` flags (after --)")
    args = p.parse_args()
    from cluster.config import default_model_dir
    model = Path(args.model) if args.model else default_model_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = Path(tempfile.mkdtemp()) / "keys"
    keys.write_text(f"attacker:{ATTACKER}\nvictim:{VICTIM}\n")
    os.chmod(keys, 0o600)
    template = keys.parent / "chatml.jinja"        # the default model has none: the chat attack needs one
    template.write_text(CHATML)
    server = start_splitserve(args.mode, model, out / "server.log", args.threads,
                              extra_args=["--api-key-file", str(keys), "--max-tokens-limit", "256",
                                          "--chat-template", str(template),
                                          *args.server_args])
    try:
        addr = tuple(server.target.removeprefix("http://").split(":"))
        addr = (addr[0], int(addr[1]))
        _run_phase(addr, 2.0, [])                                # warm-up
        results = {"machine": platform.processor() or platform.machine(), "cpu": _cpu_model(),
                   "mode": args.mode, "server_args": args.server_args, "quiet": _run_phase(addr, args.seconds, [])}
        chosen = set(args.phases.split(",")) if args.phases else None
        for name, (attackers, up_front) in _attacks(addr).items():
            if chosen is not None and name not in chosen:
                continue
            up_front = up_front()     # the attack's refused-up-front bodies, sent once
            if name == "slowloris":
                stop = threading.Event()
                held = {}
                t = threading.Thread(target=lambda: held.update(_slowloris(addr, stop)))
                t.start()
                phase = _run_phase(addr, args.seconds, [])
                t.join(90)
                phase["connections"] = held
            else:
                phase = _run_phase(addr, args.seconds, attackers)
            phase["refused_up_front"] = up_front
            quiet = results["quiet"]["victim_p50_s"]
            phase["victim_vs_quiet"] = round(phase["victim_p50_s"] / quiet, 2) if phase["victim_p50_s"] else None
            results[name] = phase
            print(f"{name:17s} victim p50 {phase['victim_p50_s'] or float('nan'):.3f}s "
                  f"({phase['victim_vs_quiet']}x quiet {quiet:.3f}s), /health worst {phase['health_worst_ms']} ms, "
                  f"attacker {phase['attacker_statuses']}, up front {up_front}"
                  + (f", connections {phase['connections']}" if "connections" in phase else ""), flush=True)
        (out / "hostile.json").write_text(json.dumps(results, indent=1))
    finally:
        server.stop()
    return 0


def _cpu_model() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
