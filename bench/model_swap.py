"""More models than memory (`--max-loaded-models`, docs/models.md): grouped batching against
first-come-first-served on a mixed load.

Three models in one colocated cluster (one worker each) with `--max-loaded-models 1`: the shipped
stdlib-coder and stdlib-coder-draft and the default model (SmolLM2-135M-Instruct, dequantized:
`--quantization none`, float32), so at
most one model's weights are loaded at a time. A closed loop of `--clients` concurrent clients
sends `--requests` greedy completions (`--max-tokens` each, EOS ignored), each naming a model drawn
at random (seeded: both arms get the same sequence), after one warm-up request per model. Each arm
(`--model-scheduling fcfs`, then `grouped`) runs in a cluster of its own. Printed per arm: model
loads per request (the workers' `model_loads`, warm-up excluded), p50 / p95 request latency,
output tok/s, wall time, and the cores busy with other work just before the arm's load.

  python bench/model_swap.py [--requests 36] [--clients 4] [--max-tokens 16] [--max-wait-ms 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cluster.config import (  # noqa: E402
    STDLIB_CODER_DIR,
    CacheConfig,
    EngineConfig,
    default_model_dir,
)
from cluster.launch.cluster_config import ClusterConfig, ModelSpec  # noqa: E402
from cluster.launch.models import start_models  # noqa: E402
from router.client import AsyncClient  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_compare import busy_s  # noqa: E402

PROMPTS = {"coder": "def fibonacci(n):\n", "draft": "import os\n\ndef list_files(path):\n",
           "smollm2": "The three primary colours are"}


def models() -> dict[str, Path]:
    return {"coder": STDLIB_CODER_DIR, "draft": STDLIB_CODER_DIR.parent / "stdlib-coder-draft",
            "smollm2": default_model_dir()}


def config(scheduling: str, max_wait_ms: float, threads: int) -> ClusterConfig:
    dirs = models()
    engine = EngineConfig(model=dirs["coder"], dtype="float32", num_threads=threads,
                          cache=CacheConfig(num_blocks=256))
    return ClusterConfig(engine=engine, served_model_name="coder", colocated=True, num_decode=1, port=0,
                         http_port=None, models=(ModelSpec(str(dirs["draft"]), "draft"),
                                                     # its GGUF's quantized tensors would be read again at every load
                                                     ModelSpec(str(dirs["smollm2"]), "smollm2", quantization="none")),
                         max_loaded_models=1, model_scheduling=scheduling, model_switch_max_wait_ms=max_wait_ms)


async def _loads(cluster) -> int:
    return sum([(await w.stats()).model_loads for c in (cluster, *cluster.models) for w in c.workers.values()])


async def _closed_loop(target: str, sequence: list[str], clients: int, max_tokens: int) -> tuple[list, int, float]:
    client, queue, latencies, tokens = AsyncClient(target), list(enumerate(sequence)), [], [0]

    async def one_client():
        while queue:
            _, model = queue.pop(0)
            t0 = time.perf_counter()
            r = await client.generate(PROMPTS[model], model=model, max_tokens=max_tokens, ignore_eos=True,
                                      temperature=0.0, timeout=600)
            latencies.append(time.perf_counter() - t0)
            tokens[0] += len(r.token_ids)
    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return latencies, tokens[0], wall


async def run_arm(scheduling: str, sequence: list[str], args) -> dict:
    cluster = await start_models(config(scheduling, args.max_wait_ms, args.threads))
    try:
        target = f"127.0.0.1:{cluster.port}"
        await _closed_loop(target, list(PROMPTS), 1, 2)     # warm-up: each model once
        busy0 = busy_s()                 # the cluster idle: what the machine does besides it
        await asyncio.sleep(2.0)
        other = (busy_s() - busy0) / 2.0
        loads0 = await _loads(cluster)
        latencies, tokens, wall = await _closed_loop(target, sequence, args.clients, args.max_tokens)
        loads = await _loads(cluster) - loads0
    finally:
        await cluster.stop()
    q = statistics.quantiles(latencies, n=20)
    return {"loads_per_request": loads / len(sequence), "loads": loads, "p50_s": statistics.median(latencies),
            "p95_s": q[18], "tok_s": tokens / wall, "wall_s": wall, "other_cores": other}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-wait-ms", type=float, default=2000.0, help="--model-switch-max-wait-ms (grouped)")
    ap.add_argument("--threads", type=int, default=1, help="threads per worker")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    sequence = [rng.choice(list(PROMPTS)) for _ in range(args.requests)]
    results = {}
    for arm in ("fcfs", "grouped"):
        results[arm] = asyncio.run(run_arm(arm, sequence, args))
        print(f"{arm}: {results[arm]}", file=sys.stderr)
    print(f"# {args.requests} requests over 3 models ({', '.join(PROMPTS)}), --max-loaded-models 1, "
          f"{args.clients} closed-loop clients, {args.max_tokens} tokens each, greedy")
    print(f"{'arm':>8} | {'loads/req':>9} | {'loads':>5} | {'p50 s':>6} | {'p95 s':>6} | {'tok/s':>6} | "
          f"{'wall s':>6} | {'other load':>10}")
    for arm, r in results.items():
        print(f"{arm:>8} | {r['loads_per_request']:>9.2f} | {r['loads']:>5} | {r['p50_s']:>6.2f} | "
              f"{r['p95_s']:>6.2f} | {r['tok_s']:>6.1f} | {r['wall_s']:>6.1f} | {r['other_cores']:>10.2f}")
    if max(r["other_cores"] for r in results.values()) > 0.3:
        print("CPU busy with other work (other load: cores busy besides the idle cluster, in a 2 s window "
              "before each arm): figures are indicative only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
