"""Agent sessions larger than the KV pools: TTFT and prompt tokens recomputed, tiers off / on / vLLM.

    PYTHONPATH=. python bench/agent_sessions.py --vllm-venv /work/vllm-venv

Each session is an agent's conversation: a long system prompt shared by every session, then turns
that each append a user instruction and a tool's output (real text: files of Python's standard
library) and the model's answer to the history, with a think time between turns. Sessions start
staggered, so many are open at once and their histories, together, are several times what the KV
pools hold: a session's next turn finds its history evicted from the pool, unless a tier below
kept it. Every request goes through the OpenAI completions API over HTTP (token-id prompts,
greedy, streamed), to `splitserve serve --colocated` (or `--layout pd`: one prefill and one decode
worker, each with the pool) with tiers off or on, and to `vllm serve` (its CPU build, prefix
caching on) with the same pool.

It prints, per mode: TTFT p50 / p99, the prompt tokens that were reusable (a prefix an earlier
request already sent, in whole 16-token blocks), how many of them each server served from its
pool or from a tier and how many it recomputed (from the servers' own Prometheus counters), and
the output throughput. The working set (distinct prompt tokens) is printed beside the pool size.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import requests

from servers import free_port, start_splitserve, start_vllm

from cluster.config import parse_memory_size as parse_size

BLOCK = 16


@dataclass
class Session:
    turns: list[list[int]]                       # what each turn appends before the model answers
    ttft: list[float] = field(default_factory=list)
    reusable: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["tiers-off", "tiers-on", "vllm"],
                    choices=["tiers-off", "tiers-on", "vllm", "vllm-offload"])
    ap.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct (the default model)")
    ap.add_argument("--vllm-venv", type=Path, default=None)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--turn-tokens", type=int, default=384, help="user instruction + tool output per turn")
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--think", type=float, default=10.0, help="seconds between a reply and the next turn")
    ap.add_argument("--stagger", type=float, default=1.0, help="seconds between session starts")
    ap.add_argument("--pool-gib", type=float, default=0.25, help="KV pool per worker (vLLM: VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="both servers' context (vLLM sizes its pool check by it)")
    ap.add_argument("--layout", choices=["colocated", "pd"], default="colocated",
                    help="colocated: one engine, one pool, as vLLM has; pd: one prefill and one decode worker, "
                         "each with the pool")
    ap.add_argument("--host-bytes", default="2GiB")
    ap.add_argument("--disk-bytes", default="4GiB")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "agent_sessions")
    return ap.parse_args()


def tool_outputs(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` token runs of `length` from the standard library's source files, in a fixed order."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out, i = [], 0
    while len(out) < n:
        ids = tokenizer.encode(files[i % len(files)].read_text(errors="replace")).ids
        i += 1
        for start in range(0, len(ids) - length, length * 4):
            out.append(ids[start:start + length])
            if len(out) == n:
                break
    return out


def build_sessions(tokenizer, args) -> tuple[list[int], list[Session]]:
    system = tool_outputs(tokenizer, 1, args.system_tokens)[0]
    tools = tool_outputs(tokenizer, args.sessions * args.turns, args.turn_tokens - 32)
    sessions = []
    for s in range(args.sessions):
        turns = []
        for t in range(args.turns):
            ask = tokenizer.encode(f"\nStep {t + 1} of task {s}: read the tool output below and say what to do next.\n").ids
            turns.append((ask + tools[s * args.turns + t])[:args.turn_tokens])
        sessions.append(Session(turns))
    return system, sessions


def run_session(target: str, system: list[int], session: Session, args, delay: float, errors: list) -> None:
    time.sleep(delay)
    history = list(system)
    url = target.rstrip("/") + "/v1/completions"
    with requests.Session() as http:
        for t, turn in enumerate(session.turns):
            if t:
                time.sleep(args.think)
            # What an earlier request already sent: the system prompt (after the first session's first
            # turn) or this session's whole history so far, in whole blocks, the last token excluded.
            seen = len(history) if t or delay else 0
            history += turn
            session.reusable += min(seen, len(history) - 1) // BLOCK * BLOCK
            session.prompt_tokens += len(history)
            body = {"model": "bench", "prompt": history, "max_tokens": args.answer_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}
            sent, first, ids = time.perf_counter(), None, []
            try:
                with http.post(url, json=body, stream=True, timeout=900) as r:
                    r.raise_for_status()
                    for line in r.iter_lines(chunk_size=None):
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        for choice in json.loads(line[6:]).get("choices") or []:
                            if choice.get("token_ids") and first is None:
                                first = time.perf_counter()
                            ids += choice.get("token_ids") or []
            except Exception as exc:  # noqa: BLE001 - reported by main
                errors.append(repr(exc))
                return
            session.ttft.append(first - sent)
            session.output_tokens += len(ids)
            history += ids


def scrape(url: str) -> dict[str, float]:
    """Prometheus text: summed value per metric name (labels merged), `_total` suffixes kept."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{")[0]
            key = name + ("{tier=" + name_labels.split('tier="')[1].split('"')[0] + "}" if 'tier="' in name_labels else "")
            out[key] = out.get(key, 0.0) + float(value)
    return out


def served_counts(mode: str, before: dict, after: dict, block: int) -> dict:
    """Prompt tokens computed, and served from the pool / host / disk, between two scrapes."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if mode.startswith("vllm"):
        return {"computed": d.get("vllm:prompt_tokens_total", 0) - d.get("vllm:prefix_cache_hits_total", 0),
                "pool": d.get("vllm:prefix_cache_hits_total", 0), "host": 0, "disk": 0}
    host = d.get("splitserve_kv_tier_loaded_blocks_total{tier=host}", 0) * block
    disk = d.get("splitserve_kv_tier_loaded_blocks_total{tier=disk}", 0) * block
    return {"computed": d.get("splitserve_prompt_tokens_computed_total", 0),
            "pool": d.get("splitserve_prefix_cache_hits_total", 0) * block - host - disk, "host": host, "disk": disk}


def start(mode: str, args, logs: Path, disk_dir: Path):
    if mode.startswith("vllm"):
        # Its CPU attention takes blocks of a multiple of 32 tokens; the pool's bytes are the same.
        extra = ["--kv-cache-memory-bytes", str(int(args.pool_gib * (1 << 30))), "--enable-prefix-caching",
                 "--block-size", "32", "--max-model-len", str(args.max_model_len)]
        if mode == "vllm-offload":       # its CPU KV offloading, where its CPU build has it
            extra += ["--kv-offloading-size", str(parse_size(args.host_bytes) / (1 << 30)),
                      "--kv-offloading-backend", "native"]
        server = start_vllm(args.vllm_venv, args.model, logs / f"{mode}.log", kv_space_gib=None, extra_args=extra,
                            timeout=600)
        return server, server.target + "/metrics"
    port = free_port()
    extra = ["--kv-cache-memory", f"{int(args.pool_gib * 1024)}MiB", "--metrics-port", str(port),
             "--block-size", str(BLOCK), "--max-model-len", str(args.max_model_len)]
    if mode == "tiers-on":
        extra += ["--kv-host-bytes", args.host_bytes, "--kv-host-shared", f"bench{os.getpid()}", "--kv-disk-dir",
                  str(disk_dir), "--kv-disk-bytes", args.disk_bytes]
    server = start_splitserve(f"{args.layout}-http", args.model, logs / f"{mode}.log", None, extra_args=extra)
    return server, f"http://127.0.0.1:{port}/metrics"


def run_mode(mode: str, args, system, sessions_of, logs: Path) -> dict:
    sessions = sessions_of()
    with tempfile.TemporaryDirectory(prefix="kv-disk-") as disk_dir:
        server, metrics = start(mode, args, logs, Path(disk_dir))
        try:
            before, errors = scrape(metrics), []
            t0 = time.perf_counter()
            threads = [threading.Thread(target=run_session, args=(server.target, system, s, args, i * args.stagger,
                                                                  errors)) for i, s in enumerate(sessions)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            after = scrape(metrics)
        finally:
            server.stop()
    if errors:
        raise RuntimeError(f"{mode}: {len(errors)} sessions failed, first: {errors[0]}")
    ttft = sorted(x for s in sessions for x in s.ttft)
    counts = served_counts(mode, before, after, BLOCK)
    reusable = sum(s.reusable for s in sessions)
    return {"mode": mode, "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "requests": len(ttft), "prompt_tokens": sum(s.prompt_tokens for s in sessions), "reusable": reusable,
            **counts, "served_share": (counts["pool"] + counts["host"] + counts["disk"]) / max(1, reusable),
            "tier_share": (counts["host"] + counts["disk"]) / max(1, reusable),
            # of the reusable tokens the pool no longer held: the share a lower tier served
            "tier_of_misses": (counts["host"] + counts["disk"]) / max(1, reusable - counts["pool"]),
            "output_tok_s": sum(s.output_tokens for s in sessions) / wall, "wall_s": wall}


def main() -> None:
    args = parse_args()
    from cluster.config import default_model_dir
    from cluster.model.loader import load_tokenizer
    args.model = (args.model or default_model_dir()).resolve()
    tokenizer = load_tokenizer(args.model)
    system, _ = build_sessions(tokenizer, args)
    working_set = args.system_tokens + args.sessions * args.turns * (args.turn_tokens + args.answer_tokens)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{args.sessions} sessions x {args.turns} turns; working set ~{working_set} tokens; pool per worker "
          f"{args.pool_gib} GiB", flush=True)
    rows = []
    header = (f"{'mode':10} {'TTFT p50':>9} {'p99':>7} {'reusable':>9} {'pool':>8} {'host':>8} {'disk':>8} "
              f"{'computed':>9} {'served':>7} {'tiers':>6} {'of miss':>7} {'out tok/s':>9}")
    for mode in args.modes:
        try:
            rows.append(run_mode(mode, args, system, lambda: build_sessions(tokenizer, args)[1], logs))
            print(header + "\n" + row_line(rows[-1]), flush=True)
        except Exception as exc:  # noqa: BLE001 - a mode that cannot run is reported, the others still are
            print(f"{mode}: could not run: {exc}", flush=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print("\n" + header)
    for r in rows:
        print(row_line(r))


def row_line(r: dict) -> str:
    return (f"{r['mode']:10} {r['ttft_p50']:9.3f} {r['ttft_p99']:7.3f} {r['reusable']:9d} {r['pool']:8.0f} "
            f"{r['host']:8.0f} {r['disk']:8.0f} {r['computed']:9.0f} {r['served_share']:7.1%} {r['tier_share']:6.1%} "
            f"{r['tier_of_misses']:7.1%} {r['output_tok_s']:9.1f}")


if __name__ == "__main__":
    main()
