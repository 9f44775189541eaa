"""What the router costs per token: a served cluster driven by real gRPC clients in other processes.

    python bench/router_capacity.py [--concurrency 32] [--frontends 1] [--colocated | --prefill 1 --decode 1]
                                    [--clients 2] [--duration 20] [--prompt-tokens 64] [--max-tokens 256]
                                    [--transport tcp] [--model DIR] [--dtype auto]
                                    [--stream-interval 1] [--speculative off|ngram|draft|eagle]

The cluster runs in this process (this process is the router, or with --frontends N the N frontend
actors are). `--clients` load-generator processes keep `--concurrency` streams open between them,
closed loop (each stream sends its next request when one ends, `ignore_eos`). After a warm-up,
CPU time is read from /proc for the frontend processes and the workers over a window of
`--duration` seconds, and each client reports the tokens it received and its own CPU. Prints
output tok/s and the CPU microseconds per token of the router/frontend processes alone (goal:
under 50 us at 32 streams) and of each worker.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "bench"))
from idle_cpu import CLK_TCK, cpu_ticks  # noqa: E402 - the one /proc reader of the benches


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads."""
    return cpu_ticks(f"/proc/{pid}/stat") / CLK_TCK


def _client(target: str, streams: int, prompts: list[list[int]], max_tokens: int, warmup: float, window: float,
            out) -> None:
    """One load-generator process: `streams` closed-loop streams; counts tokens inside the window."""
    from router.client import AsyncClient

    async def main():
        client = AsyncClient(target)
        t0 = time.perf_counter()
        start, end = t0 + warmup, t0 + warmup + window
        counted = 0
        cpu = [0.0, 0.0]

        async def stream(i):
            nonlocal counted
            j = i
            while time.perf_counter() < end:
                async for msg in client.stream(prompts[j % len(prompts)], max_tokens=max_tokens, ignore_eos=True):
                    if start <= time.perf_counter() < end:
                        counted += len(msg.token_ids)
                j += streams

        async def mark():
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
            cpu[0] = _own_cpu()
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
            cpu[1] = _own_cpu()
        await asyncio.gather(mark(), *(stream(i) for i in range(streams)))
        await client.close()
        out.send((counted, cpu[1] - cpu[0]))
    asyncio.run(main())


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--speculative", default="off")
    ap.add_argument("--colocated", action="store_true")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    import random
    from cluster.launch.app import ClusterConfig
    from cluster.config import DataPlaneConfig
    from cluster.config import EngineConfig, default_model_dir
    from cluster.model.loader import load_tokenizer
    from cluster_harness import ClusterThread
    from serve import _corpus_ids   # noqa: E402 - bench/serve.py's stdlib prompt corpus

    model = Path(args.model) if args.model else default_model_dir()
    pool = _corpus_ids(load_tokenizer(model), 50_000, 0)
    rng = random.Random(0)
    prompts = []
    for _ in range(4 * args.concurrency):
        s = rng.randrange(0, len(pool) - args.prompt_tokens)
        prompts.append(pool[s:s + args.prompt_tokens])
    from cluster.config import SpeculativeConfig
    engine = EngineConfig(model=model, dtype=args.dtype, speculative=SpeculativeConfig(method=args.speculative))
    cfg = ClusterConfig(http_port=None, engine=engine, colocated=args.colocated,
                        num_prefill=args.prefill, num_decode=args.decode,
                        data_plane=DataPlaneConfig(transport=args.transport, stream_interval=args.stream_interval),
                        port=0,
                        frontends=args.frontends, max_tokens_limit=max(4096, args.max_tokens))
    cluster = ClusterThread(cfg)
    try:
        frontends = cluster.cluster.frontend_pids()
        workers = {s.name: s.pid for s in cluster.stats()}
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        per = [args.concurrency // args.clients + (i < args.concurrency % args.clients) for i in range(args.clients)]
        for i, n in enumerate(per):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_client, args=(cluster.target, n, prompts[i::args.clients], args.max_tokens,
                                                  args.warmup, args.duration, b))
            p.start()
            pipes.append(a)
            procs.append(p)
        time.sleep(args.warmup)
        before = {pid: cpu_seconds(pid) for pid in [*frontends, *workers.values()]}
        time.sleep(args.duration)
        after = {pid: cpu_seconds(pid) for pid in before}
        results = [a.recv() for a in pipes]
        for p in procs:
            p.join(60)
    finally:
        cluster.stop()
    tokens = sum(r[0] for r in results)
    router_cpu = sum(after[p] - before[p] for p in frontends)
    mode = "colocated" if args.colocated else f"{args.prefill}P{args.decode}D"
    print(f"router capacity: {mode}, transport {args.transport}, {args.frontends} frontend(s), "
          f"{args.concurrency} streams from {args.clients} client processes, {args.duration:.0f} s window, "
          f"stream interval {args.stream_interval}, speculative {args.speculative}")
    print(f"  output tokens/s                 {tokens / args.duration:10.1f}")
    print(f"  router CPU us/token             {1e6 * router_cpu / max(1, tokens):10.1f}   "
          f"({100 * router_cpu / args.duration:.1f}% of a core, {len(frontends)} process(es))")
    for name, pid in workers.items():
        used = after[pid] - before[pid]
        print(f"  {name:<22} CPU us/token {1e6 * used / max(1, tokens):10.1f}   ({100 * used / args.duration:.1f}% of a core)")
    client_cpu = sum(r[1] for r in results)
    print(f"  load generators CPU us/token    {1e6 * client_cpu / max(1, tokens):10.1f}   "
          f"({100 * client_cpu / args.duration:.1f}% of a core, reported by the clients)")


if __name__ == "__main__":
    main()
