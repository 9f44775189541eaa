"""`vllm serve` (vLLM's CPU build) beside `splitserve serve`, one after the other on this machine.

    python bench/serve_vs_vllm.py --vllm-venv /work/vllm-venv [--model DIR] [--prompt-tokens 512]
        [--max-tokens 128] [--concurrency 1 8 32] [--requests-per-level N]
        [--modes vllm colocated colocated-http pd pd-http] [--out DIR] [--smoke]

Modes (bench/servers.py starts each):
  vllm            `vllm serve`, loaded over its OpenAI-compatible HTTP API
  colocated       `splitserve serve --colocated`, loaded over gRPC (router/client.py's AsyncClient)
  pd              `splitserve serve --prefill 1 --decode 1` (1P1D), loaded over gRPC
  colocated-http  the colocated cluster with `--http-port PORT --served-model-name bench`, loaded over
                  splitserve's OpenAI-compatible HTTP API by the very client code that loads vLLM
  pd-http         the 1P1D cluster with the HTTP API, the same
  main-job        `splitserve serve` with all its defaults (model, dtype, quantization, 1P1D), over gRPC:
                  the README's main job against vLLM on the bf16 copy

Each mode's server starts as a subprocess on 127.0.0.1, gets a short warm-up and then a closed loop
at each concurrency C: C streams, each sending its next request as soon as the last one finished.
The load comes from a separate process (bench/loadgen.py) that reports its own CPU time: its
"openai_http" backend (streaming POST /v1/completions with token-id prompts, return_token_ids and
stream_options.include_usage) for vllm and the -http modes alike, so that vLLM and splitserve are
measured through the same client; its "splitserve" backend (gRPC) for colocated and pd.
Every mode gets the same prompts, exactly --prompt-tokens token ids cut from Python standard library
source (as in bench/serve.py), each prompt distinct so no level hits another's prefix cache;
decoding is greedy with ignore_eos, so every request returns --max-tokens tokens (checked against
the tokens received and, over HTTP, the server's usage.completion_tokens; over gRPC, the count received).

Prints per concurrency and mode, the HTTP modes side by side with vllm and the gRPC modes: output
tok/s (all tokens / first send to last token), its ratio to vLLM, TTFT and inter-token latency
p50/p99, TPOT, the load generator's CPU seconds; then how each -http mode compares with its gRPC
counterpart (the HTTP frontend's cost) and whether the greedy outputs agree; then the in-process
engine's batch-1 decode tok/s on the same prompts (a subprocess; `LLMEngine.from_model_dir`, the
documented call) and the served concurrency-1 throughput as a fraction of it.

Server CPU per output token, per concurrency and mode: the load generator reads utime+stime of every
process of the server at the start and end of each level's timed window (bench/proc_cpu.py) and
splits it by role: frontend (vLLM: the `vllm serve` API server process; splitserve: the `serve`
driver, where the router and, with the default --frontends 1, the frontend run), engine (vLLM: its
EngineCore and the Worker under it; splitserve: the ray::PrefillWorker / ray::DecodeWorker actors)
and other (Ray's own processes, vLLM's resource tracker). Printed in microseconds per output token,
with each frontend's ratio to vLLM's API server at the same load; the goal: at most 1.00x.

Writes serve_vs_vllm.json (per mode: its summary, its client, and "vs_vllm", the output tok/s ratios
to vLLM per concurrency; each level's summary has "cpu_us_per_token" and "server_cpu_s" by role, and
"raw" each level's per-process "server_cpu") and serve_vs_vllm.png to --out, and the servers' logs
under --out/logs. Without --vllm-venv only the splitserve modes run.

vLLM runs with VLLM_CPU_OMP_THREADS_BIND over all of this process's CPUs, VLLM_CPU_KVCACHE_SPACE
(--vllm-kv-gib), dtype bfloat16 and, with --vllm-preload auto, LD_PRELOAD of tcmalloc (if
libgoogle-perftools4 is installed) and the venv's libiomp5.so. splitserve runs as `splitserve serve`
does by default: no --num-threads (its placement leaves one core to the router, frontends and Ray
and splits the rest between the workers, each pinned to its share), unless --splitserve-threads N
gives each worker N threads; the in-process baseline gets the engine's default threads, or N.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's cluster/ and router/
sys.path.insert(1, str(Path(__file__).resolve().parent))
from serve import summarize  # noqa: E402  (bench/serve.py: TTFT/ITL percentiles, output tok/s)
from servers import SERVED_NAME, SPLITSERVE_MODES, start_splitserve, start_vllm  # noqa: E402

LOADGEN = Path(__file__).resolve().parent / "loadgen.py"
KEYS = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
MODES = ("vllm", *SPLITSERVE_MODES)   # vllm colocated pd colocated-http pd-http
DEFAULT_MODES = ["vllm", "colocated", "colocated-http", "pd", "pd-http"]


def is_http(mode: str) -> bool:
    """Loaded over the OpenAI-compatible HTTP API (vLLM and the -http modes), not over gRPC."""
    return mode == "vllm" or mode.endswith("-http")


def client_of(mode: str) -> str:
    return "http" if is_http(mode) else "grpc"


def grpc_twin(mode: str) -> str | None:
    """The gRPC mode with the same cluster as an -http mode ("pd-http" -> "pd")."""
    return mode.removesuffix("-http") if mode.endswith("-http") else None


def ratios_to_vllm(summary: dict) -> dict:
    """{mode: {concurrency: output tok/s / vLLM's}} for every mode but vllm; {} without vllm."""
    base = summary.get("vllm")
    if not base:
        return {}
    return {mode: {c: s["output_tok_s"] / base[c]["output_tok_s"] for c, s in levels.items() if c in base}
            for mode, levels in summary.items() if mode != "vllm"}


def frontend_cpu_vs_vllm(summary: dict) -> dict:
    """{mode: {concurrency: frontend CPU per token / vLLM's API server's}} (the goal: <= 1)."""
    base = summary.get("vllm")
    if not base:
        return {}
    per_token = lambda s: (s.get("cpu_us_per_token") or {}).get("frontend")   # noqa: E731
    return {mode: {c: per_token(s) / per_token(base[c]) for c, s in levels.items()
                   if c in base and per_token(s) is not None and per_token(base[c])}
            for mode, levels in summary.items() if mode != "vllm"}


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def other_load(seconds: float = 2.0) -> float:
    """Fraction of the machine's CPU time busy while this benchmark runs nothing (between servers):
    other people's work, which skews every figure here."""
    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]   # total, idle + iowait
    (t0, i0), _ = sample(), time.sleep(seconds)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def make_prompts(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of exactly `length` token ids: consecutive slices of stdlib modules,
    each module used once, in a seeded shuffled order."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    pool: list[int] = []
    for f in files:
        if len(pool) >= n * length:
            break
        pool.extend(tokenizer.encode(f.read_text(errors="replace"), add_special_tokens=False).ids)
    if len(pool) < n * length:
        raise ValueError(f"the standard library gives {len(pool)} tokens, {n} x {length} are needed")
    return [pool[i * length:(i + 1) * length] for i in range(n)]


def run_loadgen(spec: dict, work: Path, name: str) -> dict:
    """Run bench/loadgen.py on `spec` in a subprocess and return its result."""
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(LOADGEN.parents[1]),
                                                                    os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, str(LOADGEN), str(spec_path), str(out_path)], check=True, env=env)
    return json.loads(out_path.read_text())


def reused_levels(work: Path, mode: str, warmup: dict, levels: list[dict]) -> list | None:
    """An earlier run's levels of `mode` from `work`, when it loaded the same prompts at the same
    levels (--reuse: vLLM's levels take minutes each on a small CPU); None otherwise."""
    spec_path, out_path = work / f"{mode}.spec.json", work / f"{mode}.out.json"
    if not (spec_path.is_file() and out_path.is_file()):
        return None
    spec = json.loads(spec_path.read_text())
    if spec.get("warmup") != warmup or spec.get("levels") != levels:
        return None
    return json.loads(out_path.read_text())["levels"]


def level_summary(level: dict, max_tokens: int) -> dict:
    s = {k: v for k, v in summarize(level["results"], float("inf"), float("inf")).items() if k in KEYS}
    # Time per output token after the first, per request (vLLM's TPOT): unlike the ITL percentiles it
    # does not drop to ~0 when a busy frontend delivers several tokens at once.
    s["tpot_mean"] = sum(sum(r["itl"]) / max(1, r["tokens"] - 1) for r in level["results"]) / len(level["results"])
    s["tokens"] = sum(r["tokens"] for r in level["results"])
    s["reported_tokens"] = sum(r["reported_tokens"] for r in level["results"])
    s["tokens_ok"] = s["tokens"] == s["reported_tokens"] == len(level["results"]) * max_tokens
    s["loadgen_cpu_s"], s["wall_s"] = level["cpu_s"], level["wall_s"]
    s["requests"] = len(level["results"])
    if level.get("server_cpu"):
        s["server_cpu_s"], s["server_cpu_wall_s"] = level["server_cpu"]["cpu_s"], level["server_cpu"]["wall_s"]
        s["cpu_us_per_token"] = {role: 1e6 * sec / max(1, s["tokens"]) for role, sec in s["server_cpu_s"].items()}
    return s


def print_table(summary: dict, concurrency: list[int], args) -> None:
    w = max(9, *(len(m) for m in summary))
    head = (f"{'conc':>4} {'mode':>{w}} {'client':>6} | {'out tok/s':>9} {'vs vLLM':>7} | {'TTFT p50':>8} {'p99':>7} | "
            f"{'ITL p50':>7} {'p99':>6} {'TPOT':>6} | {'loadgen CPU s':>13} | {'tokens':>7}")
    print(f"\n# {args.model.name}, prompts {args.prompt_tokens} tokens, {args.max_tokens} new (greedy, ignore_eos), "
          f"closed loop; latencies in ms; client: the load generator's (http: the same OpenAI HTTP client "
          f"for vLLM and splitserve's -http modes)")
    print(head)
    print("-" * len(head))
    vs = ratios_to_vllm(summary)
    for c in concurrency:
        for mode, levels in summary.items():
            s = levels[c]
            ratio = f"{vs[mode][c]:.2f}x" if c in vs.get(mode, {}) else ""
            cpu = f"{s['loadgen_cpu_s']:.1f} ({100 * s['loadgen_cpu_s'] / s['wall_s']:.0f}%)"
            toks = f"{s['tokens']}" + ("" if s["tokens_ok"] else " BAD")
            print(f"{c:>4} {mode:>{w}} {client_of(mode):>6} | {s['output_tok_s']:>9.1f} {ratio:>7} | "
                  f"{1e3 * s['ttft_p50']:>8.1f} {1e3 * s['ttft_p99']:>7.1f} | {1e3 * s['itl_p50']:>7.2f} "
                  f"{1e3 * s['itl_p99']:>6.1f} {1e3 * s['tpot_mean']:>6.2f} | "
                  f"{cpu:>13} | {toks:>7}")


def print_cpu_table(summary: dict, concurrency: list[int]) -> None:
    """Server CPU per output token by process role, each level's timed window (bench/proc_cpu.py)."""
    modes = [m for m, lv in summary.items() if all("cpu_us_per_token" in lv[c] for c in concurrency)]
    if not modes:
        return
    w, vs = max(9, *(len(m) for m in modes)), frontend_cpu_vs_vllm(summary)
    head = (f"{'conc':>4} {'mode':>{w}} | {'frontend':>8} {'vs vLLM':>7} | {'engine':>8} | {'other':>7} | "
            f"{'total':>8} | {'frontend % core':>15}")
    print("\n# server CPU, microseconds per output token, by process: frontend = vLLM's API server (`vllm serve`) / "
          "splitserve's serve driver (router + frontend); engine = vLLM's EngineCore + Worker / the worker actors; "
          "other = the rest (Ray's own processes); /proc counts 1/CLK_TCK s ticks, coarse over short levels. "
          "Goal: frontend at most vLLM's (vs vLLM <= 1.00x)")
    print(head)
    print("-" * len(head))
    for c in concurrency:
        for mode in modes:
            s = summary[mode][c]
            us, sec = s["cpu_us_per_token"], s["server_cpu_s"]
            ratio = f"{vs[mode][c]:.2f}x" if c in vs.get(mode, {}) else ""
            print(f"{c:>4} {mode:>{w}} | {us['frontend']:>8.0f} {ratio:>7} | {us['engine']:>8.0f} | {us['other']:>7.0f} | "
                  f"{sum(us.values()):>8.0f} | {100 * sec['frontend'] / s['server_cpu_wall_s']:>14.0f}%")
    for mode, levels in vs.items():
        met = [c for c, r in levels.items() if r <= 1.0]
        print(f"frontend CPU per token <= vLLM's, {mode}: at {', '.join(map(str, met)) or 'no level'} "
              f"of {', '.join(map(str, levels))}")


def engine_baseline(results: list[dict]) -> dict:
    """Batch-1 decode tok/s of the in-process engine: tokens after the first over the time after the
    first; and end to end (prefill included), as the served figure is. Medians over the requests:
    one request slowed by other work on the machine should not move the ceiling."""
    return {"decode_tok_s": _median([(r["tokens"] - 1) / sum(r["itl"]) for r in results]),
            "end_to_end_tok_s": _median([r["tokens"] / (r["ttft"] + sum(r["itl"])) for r in results]),
            "ttft_ms": 1e3 * _median([r["ttft"] for r in results])}


def plot(summary: dict, concurrency: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, levels in summary.items():
        line = axes[0].plot(concurrency, [levels[c]["output_tok_s"] for c in concurrency], "o-", label=mode)[0]
        for ax, key in ((axes[1], "ttft"), (axes[2], "itl")):
            color = line.get_color()
            ax.plot(concurrency, [1e3 * levels[c][f"{key}_p50"] for c in concurrency], "o-", color=color,
                    label=f"{mode} p50")
            ax.plot(concurrency, [1e3 * levels[c][f"{key}_p99"] for c in concurrency], "x--", color=color,
                    label=f"{mode} p99")
    axes[0].set(ylabel="output tok/s", title="throughput")
    axes[1].set(ylabel="ms", yscale="log", title="time to first token")
    axes[2].set(ylabel="ms", yscale="log", title="inter-token latency")
    for ax in axes:
        ax.set(xscale="log", xlabel="concurrent streams")
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.legend(fontsize=8)
        ax.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", type=Path, default=None, help="venv with vLLM's CPU build (vllm-cpu)")
    ap.add_argument("--model", type=Path, default=None, help="Hugging Face checkpoint directory, served in bfloat16 by both (default: the project's "
                         "default model, SmolLM2-135M-Instruct, converted from its GGUF; SPLITSERVE_MODEL overrides)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-level", type=int, default=None,
                    help="requests at each concurrency level (default: max(8, 3 x concurrency))")
    ap.add_argument("--warmup-requests", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=MODES,
                    help="vllm (HTTP); colocated, pd (splitserve over gRPC); colocated-http, pd-http (splitserve "
                         "over its OpenAI HTTP API, `--http-port`, through the client that loads vLLM); "
                         f"default: {' '.join(DEFAULT_MODES)}")
    ap.add_argument("--transport", default="nixl", choices=["nixl", "ucx", "tcp"], help="KV transport for pd")
    ap.add_argument("--splitserve-threads", type=int, default=None,
                    help="torch threads per worker, as `serve --num-threads` (default: none given, so splitserve's "
                         "own placement: one core for the router, frontends and Ray, the rest split between "
                         "the workers); also the in-process baseline's")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-preload", choices=["auto", "none"], default="auto",
                    help="auto: LD_PRELOAD tcmalloc (if installed) and the venv's libiomp5.so")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    ap.add_argument("--no-engine-baseline", action="store_true", help="skip the in-process batch-1 measurement")
    ap.add_argument("--reuse", nargs="*", default=[], metavar="MODE",
                    help="modes whose results an earlier run left in --out/work for the same prompts and levels are "
                         "read from there, not run again (vLLM's levels take minutes each here)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes to check the whole path: 2 requests per level, 64-token prompts, 8 new "
                         "tokens, concurrency 1 and 2")
    args = ap.parse_args()
    if args.smoke:
        args.prompt_tokens, args.max_tokens, args.concurrency = 64, 8, [1, 2]
        args.requests_per_level, args.warmup_requests = 2, 2
    if args.vllm_venv is None and "vllm" in args.modes:
        print("no --vllm-venv: running the splitserve modes only", file=sys.stderr)
        args.modes = [m for m in args.modes if m != "vllm"]
        if not args.modes:
            ap.error("nothing to run: give --vllm-venv or a splitserve mode")
    from cluster.config import default_model_dir
    args.model = (args.model or default_model_dir()).resolve()
    if not (args.model / "tokenizer.json").is_file():
        ap.error(f"{args.model} has no tokenizer.json (both servers need it)")
    return args


def main() -> int:
    args = parse_args()
    from cluster.model.loader import load_tokenizer
    ncpu = len(os.sched_getaffinity(0))
    levels = sorted(set(args.concurrency))
    n_per = {c: args.requests_per_level or max(8, 3 * c) for c in levels}
    prompts = make_prompts(load_tokenizer(args.model), args.warmup_requests + sum(n_per.values()),
                           args.prompt_tokens)
    warmup = {"concurrency": min(args.warmup_requests, max(levels)), "prompts": prompts[:args.warmup_requests]}
    spec_levels, at = [], args.warmup_requests
    for c in levels:
        spec_levels.append({"concurrency": c, "prompts": prompts[at:at + n_per[c]]})
        at += n_per[c]
    args.out.mkdir(parents=True, exist_ok=True)
    work, logs = args.out / "work", args.out / "logs"
    work.mkdir(exist_ok=True)
    print(f"{args.model.name}: {ncpu} CPUs, modes {' '.join(args.modes)}, concurrency {levels}, "
          f"requests {[n_per[c] for c in levels]}", file=sys.stderr)

    raw, summary, servers_info, busy = {}, {}, {}, {}
    for mode in args.modes:
        reused = reused_levels(work, mode, warmup, spec_levels) if mode in args.reuse else None
        if reused is not None:
            print(f"{mode}: reusing {work / f'{mode}.out.json'} (same prompts and levels)", file=sys.stderr)
            raw[mode], servers_info[mode], busy[mode] = reused, {"reused": str(work / f"{mode}.out.json")}, 0.0
            summary[mode] = {lv["concurrency"]: level_summary(lv, args.max_tokens) for lv in raw[mode]}
            continue
        busy[mode] = other_load()
        t0 = time.perf_counter()
        print(f"{mode}: starting the server", file=sys.stderr, flush=True)
        if mode == "vllm":
            server = start_vllm(args.vllm_venv, args.model, logs / "vllm.log", args.vllm_kv_gib, args.vllm_preload,
                                args.vllm_arg)
        else:
            # No --num-threads unless asked: what `splitserve serve` does by default is measured.
            server = start_splitserve(mode, args.model, logs / f"{mode}.log", args.splitserve_threads, args.transport)
            server.info["threads_per_worker"] = args.splitserve_threads or "default placement"
        server.info["client"] = client_of(mode)
        print(f"{mode}: ready in {time.perf_counter() - t0:.0f} s at {server.target}", file=sys.stderr, flush=True)
        try:
            # The same loadgen backend, one client code path, for vLLM and splitserve's HTTP API.
            spec = {"backend": "openai_http" if is_http(mode) else "splitserve", "target": server.target,
                    "model": SERVED_NAME, "max_tokens": args.max_tokens, "warmup": warmup, "levels": spec_levels,
                    "server": {"pid": server.proc.pid, "kind": "vllm" if mode == "vllm" else "splitserve"}}
            raw[mode] = run_loadgen(spec, work, mode)["levels"]
        finally:
            server.stop()
        servers_info[mode] = server.info
        summary[mode] = {lv["concurrency"]: level_summary(lv, args.max_tokens) for lv in raw[mode]}

    engine = None
    if not args.no_engine_baseline and 1 in levels:
        busy["engine"] = other_load()
        print("engine: in-process batch-1 run (subprocess)", file=sys.stderr, flush=True)
        threads = args.splitserve_threads   # None: the engine's default, as a user of the API gets
        spec = {"backend": "engine", "target": str(args.model), "threads": threads, "max_tokens": args.max_tokens,
                "warmup": {"concurrency": 1, "prompts": prompts[:1]}, "levels": [spec_levels[0]]}
        engine = engine_baseline(run_loadgen(spec, work, "engine")["levels"][0]["results"])
        engine["threads"] = threads or "default"

    report(args, levels, n_per, raw, summary, busy, engine)
    vs = ratios_to_vllm(summary)
    modes = {m: {"client": client_of(m), "vs_vllm": vs.get(m), "levels": summary[m]} for m in summary}
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "cpus": ncpu, "servers": servers_info,
              "other_load": busy, "modes": modes, "summary": summary, "vs_vllm": vs,
              "frontend_cpu_vs_vllm": frontend_cpu_vs_vllm(summary), "engine_batch1": engine,
              "raw": raw}
    (args.out / "serve_vs_vllm.json").write_text(json.dumps(result, indent=1))
    plot(summary, levels, args.out / "serve_vs_vllm.png")
    print(f"wrote {args.out / 'serve_vs_vllm.json'} and {args.out / 'serve_vs_vllm.png'}", file=sys.stderr)
    bad = [(m, c) for m, lv in summary.items() for c, s in lv.items() if not s["tokens_ok"]]
    if bad:
        print(f"output token counts wrong for {bad}", file=sys.stderr)
    return 1 if bad else 0


def report(args, levels: list[int], n_per: dict, raw: dict, summary: dict, busy: dict, engine: dict | None) -> None:
    print_table(summary, levels, args)
    print_cpu_table(summary, levels)
    print("CPU busy with other work just before each run: " + ", ".join(f"{m} {b:.0%}" for m, b in busy.items())
          + ("  <- not a quiet machine: compare with care" if max(busy.values()) > 0.2 else ""))
    for c in levels:
        counts = ", ".join(f"{m} {summary[m][c]['tokens']}/{summary[m][c]['reported_tokens']}" for m in summary)
        print(f"output tokens at concurrency {c} (received/server-reported), expected {n_per[c] * args.max_tokens}"
              f" each: {counts}")
    def same_outputs(a: str, b: str) -> str:
        same = [sum(x["token_ids"] == y["token_ids"] for x, y in zip(la["results"], lb["results"]))
                for la, lb in zip(raw[a], raw[b])]
        return ", ".join(f"{s}/{n_per[c]} at {c}" for s, c in zip(same, levels))
    if "vllm" in raw:
        for mode in (m for m in raw if m != "vllm"):
            print(f"greedy outputs equal to vLLM's, {mode}: {same_outputs('vllm', mode)}")
    for mode in summary:
        twin = grpc_twin(mode)
        if twin in summary:
            print(f"{mode} (HTTP) vs {twin} (gRPC), the same cluster: output tok/s " +
                  ", ".join(f"{summary[mode][c]['output_tok_s'] / summary[twin][c]['output_tok_s']:.2f}x at {c}"
                            for c in levels) +
                  f"; greedy outputs equal: {same_outputs(twin, mode)}")
    if engine:
        print(f"\nin-process engine, batch 1 ({engine['threads']} threads): decode {engine['decode_tok_s']:.1f} tok/s, "
              f"end to end (prefill included) {engine['end_to_end_tok_s']:.1f} tok/s, TTFT {engine['ttft_ms']:.1f} ms")
        for mode, lv in summary.items():
            tok_s = lv[1]["output_tok_s"]
            print(f"  served concurrency 1, {mode:>14}: {tok_s:6.1f} tok/s = {tok_s / engine['decode_tok_s']:.0%} of "
                  f"engine decode, {tok_s / engine['end_to_end_tok_s']:.0%} of engine end to end (goal: >= 90%)")


if __name__ == "__main__":
    sys.exit(main())
