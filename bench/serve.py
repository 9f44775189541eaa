"""Serving benchmark against the gRPC API: open loop, Poisson arrivals, P/D beside colocated.

    python bench/serve.py [--model DIR] [--workload chat|long|shared] [--rate R] [--requests N]
                          [--modes pd colocated] [--out bench/results]

For each mode it starts a cluster (1 prefill + 1 decode, or one colocated worker) on this
machine, sends the same requests at the same Poisson arrival times, and records when each
token arrives. It prints TTFT and inter-token latency p50/p90/p99, output throughput and goodput
(requests per second whose TTFT and p99 ITL meet the objectives), and writes a JSON of results and
PNG plots (ITL and TTFT distributions) to --out.

Workloads (prompts are Python standard library source, tokenized by the model's tokenizer):
  chat    prompts of 100-400 tokens, 64-128 new tokens
  long    prompts of ~1500 tokens, 32 new tokens, mixed with chat requests (prefill interference)
  shared  a 1000-token shared system prompt + 20-80 unique tokens, 64 new tokens
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import sysconfig
import time
from pathlib import Path


def _corpus_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids.extend(tokenizer.encode(rng.choice(files).read_text(errors="replace")).ids)
    return ids


def make_workload(name: str, tokenizer, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    pool = _corpus_ids(tokenizer, 400_000, seed)

    def chunk(length: int) -> list[int]:
        start = rng.randrange(0, len(pool) - length)
        return pool[start:start + length]
    out = []
    system = chunk(1000)
    for i in range(n):
        if name == "chat" or (name == "long" and i % 4):
            out.append((chunk(rng.randint(100, 400)), rng.randint(64, 128)))
        elif name == "long":
            out.append((chunk(1500), 32))
        else:
            out.append((system + chunk(rng.randint(20, 80)), 64))
    return out


async def run_load(target: str, requests, rate: float, seed: int = 0) -> list[dict]:
    from router.client import AsyncClient
    client = AsyncClient(target)
    rng = random.Random(seed)
    results = []

    async def one(i, prompt, max_tokens, at):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        sent = time.perf_counter()
        times = []
        async for msg in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
            now = time.perf_counter()
            times.extend([now] * len(msg.token_ids))
        results.append({"i": i, "prompt_tokens": len(prompt), "sent": sent - t0,
                        "ttft": times[0] - sent, "itl": [b - a for a, b in zip(times, times[1:])],
                        "tokens": len(times), "done": times[-1] - t0})
        done = len(results)
        if done % max(1, len(requests) // 20) == 0 or done == len(requests):
            bar = "#" * (20 * done // len(requests))
            print(f"\r  [{bar:<20}] {done}/{len(requests)}", end="", file=sys.stderr, flush=True)
    arrivals, t = [], 0.0
    for _ in requests:
        t += rng.expovariate(rate)
        arrivals.append(t)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p, m, a) for i, ((p, m), a) in enumerate(zip(requests, arrivals))))
    print(file=sys.stderr)
    await client.close()
    return sorted(results, key=lambda r: r["i"])


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(results, ttft_slo: float, itl_slo: float) -> dict:
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    span = max(r["done"] for r in results) - min(r["sent"] for r in results)
    good = [r for r in results if r["ttft"] <= ttft_slo and (not r["itl"] or _pct(r["itl"], 0.99) <= itl_slo)]
    return {"ttft_p50": _pct(ttft, .5), "ttft_p90": _pct(ttft, .9), "ttft_p99": _pct(ttft, .99),
            "itl_p50": _pct(itl, .5), "itl_p90": _pct(itl, .9), "itl_p99": _pct(itl, .99),
            "itl_p99_over_p50": _pct(itl, .99) / max(1e-9, _pct(itl, .5)),
            "output_tok_s": sum(r["tokens"] for r in results) / span, "goodput_rps": len(good) / span,
            "requests": len(results)}


def plot(all_results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, results in all_results.items():
        itl = sorted(x * 1e3 for r in results for x in r["itl"])
        ttft = sorted(r["ttft"] * 1e3 for r in results)
        axes[0].plot(itl, [i / len(itl) for i in range(len(itl))], label=mode)
        axes[1].plot(ttft, [i / len(ttft) for i in range(len(ttft))], label=mode)
    axes[0].set(xscale="log", xlabel="inter-token latency (ms)", ylabel="fraction", title="ITL CDF")
    axes[1].set(xscale="log", xlabel="time to first token (ms)", title="TTFT CDF")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", choices=["chat", "long", "shared"], default="long")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--modes", nargs="+", default=["pd", "colocated"], choices=["pd", "colocated"])
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--itl-slo", type=float, default=0.2)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    from cluster.launch.app import ClusterConfig, start_cluster
    from cluster.config import DataPlaneConfig
    from cluster.config import CacheConfig, EngineConfig, default_model_dir
    from cluster.model.loader import load_tokenizer
    model = Path(args.model) if args.model else default_model_dir()
    requests = make_workload(args.workload, load_tokenizer(model), args.requests)
    engine = EngineConfig(model=model, num_threads=1, cache=CacheConfig(memory_budget_bytes=2 << 30))
    all_results, summary = {}, {}

    async def run_mode(mode: str):
        cfg = ClusterConfig(http_port=None, engine=engine, colocated=mode == "colocated",
                            data_plane=DataPlaneConfig(transport=args.transport), port=0,
                            max_tokens_limit=4096)
        cluster = await start_cluster(cfg)
        try:
            await run_load(f"127.0.0.1:{cluster.port}", requests[:4], rate=50.0)     # warm-up
            return await run_load(f"127.0.0.1:{cluster.port}", requests, args.rate)
        finally:
            await cluster.stop()
    for mode in args.modes:
        print(f"{mode}: {args.requests} {args.workload} requests at {args.rate}/s", file=sys.stderr)
        all_results[mode] = asyncio.run(run_mode(mode))
        summary[mode] = summarize(all_results[mode], args.ttft_slo, args.itl_slo)
    print(f"# {args.workload} workload, {args.requests} requests, Poisson {args.rate}/s, {model.name}, "
          f"SLO TTFT <= {args.ttft_slo}s and p99 ITL <= {args.itl_slo * 1e3:.0f} ms")
    keys = ["ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99"]
    print(f"{'mode':>10} | " + " | ".join(f"{k + ' ms':>12}" for k in keys)
          + f" | {'p99/p50 ITL':>11} | {'tok/s':>6} | {'goodput r/s':>11}")
    for mode, s in summary.items():
        print(f"{mode:>10} | " + " | ".join(f"{s[k] * 1e3:>12.1f}" for k in keys)
              + f" | {s['itl_p99_over_p50']:>11.2f} | {s['output_tok_s']:>6.0f} | {s['goodput_rps']:>11.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"serve_{args.workload}.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "results": all_results}, indent=1))
    plot(all_results, args.out)
    print(f"wrote {args.out / f'serve_{args.workload}.json'} and {args.out / 'latency_cdf.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
