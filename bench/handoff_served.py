"""Where a served P/D handoff's time goes: from the router sending the handle to the first decode step.

    python bench/handoff_served.py [--transports nixl tcp] [--prompt-tokens 512] [--requests 20]
                                   [--concurrency 1] [--model DIR]

For each transport it starts a 1 prefill + 1 decode cluster in this process, sends `--requests`
prompts (`--concurrency` at a time, 16 new tokens each) and prints the median and p90 of each
phase the decode worker records (`decode/handoff.py: HandoffTiming`): the Ray call, the wait for
the engine thread, the read, the checksum, the producer's ACK, and the join into the next step.
Everything but `read` (and `verify`, which checks the bytes) is a wait that is not transfer time.
The last columns count the handoffs that failed (the decode worker recomputed the prompt) and
those declined for want of blocks: at concurrency 16 on one thread per worker, a producer that
answered only between its multi-second prefill steps failed most of them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
PHASES = ("call", "queue", "read", "verify", "confirm", "join")


def run(transport: str, args, prompts) -> list:
    import ray
    from cluster.launch.app import ClusterConfig
    from cluster.config import DataPlaneConfig
    from router.router import RouterConfig
    from cluster.config import EngineConfig
    from cluster_harness import ClusterThread
    from router.client import Client
    engine = EngineConfig(model=args.model) if args.model else EngineConfig()
    c = ClusterThread(ClusterConfig(http_port=None, engine=engine, data_plane=DataPlaneConfig(transport=transport), port=0,
                                    router=RouterConfig(local_prefill_max_tokens=0)))
    try:
        client = Client(c.target)
        client.generate(prompts[0][:64], max_tokens=4)                     # warm-up
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda p: client.generate(p, max_tokens=16, ignore_eos=True), prompts))
        decode = next(w for n, w in c.cluster.workers.items() if n.startswith("decode"))
        timings = ray.get(decode.handle.handoff_timings.remote())[1:]     # without the warm-up's
        return timings, ray.get(decode.handle.stats.remote()).handoff
    finally:
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transports", nargs="+", default=["nixl", "tcp"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    import random
    from cluster.config import default_model_dir
    from cluster.model.loader import load_tokenizer
    from serve import _corpus_ids   # bench/serve.py's stdlib prompt corpus
    pool = _corpus_ids(load_tokenizer(args.model or default_model_dir()), 60_000, 1)
    rng = random.Random(1)
    prompts = []
    for _ in range(args.requests):
        s = rng.randrange(0, len(pool) - args.prompt_tokens)
        prompts.append(pool[s:s + args.prompt_tokens])
    print(f"served handoff phases, ms (median / p90), {args.prompt_tokens}-token prompts, "
          f"{args.requests} requests, concurrency {args.concurrency}")
    print(f"{'transport':<10}" + "".join(f"{p:>16}" for p in (*PHASES, "total")))
    for transport in args.transports:
        rows, counts = run(transport, args, prompts)
        tally = f"({len(rows)} timed; done {counts.done}, failed {counts.failed}, declined {counts.declined})"
        if not rows:
            print(f"{transport:<10}   no handoff completed {tally}")
            continue
        cols = [[getattr(r, p) for r in rows] for p in PHASES]
        cols.append([sum(getattr(r, p) for p in PHASES) for r in rows])
        cells = []
        for col in cols:
            col = sorted(col)
            cells.append(f"{1e3 * statistics.median(col):7.2f} /{1e3 * col[int(0.9 * (len(col) - 1))]:7.2f}")
        print(f"{transport:<10}" + "".join(f"{c:>16}" for c in cells)
              + f"   {tally}")


if __name__ == "__main__":
    main()
