"""Measure a worker's step costs for the planner and the simulator: a device profile (JSON).

    python bench/planner_profile.py [--model DIR|FILE.gguf] [--out cluster/planner/cpu-default.json]
        [--prefill 16,128,512,2048] [--batches 1,4,16,32] [--contexts 64,512] [--kv-bandwidth BYTES/S]
        [--dtype D] [--quantization Q] [--threads N] [--worker-start S] [--switch S]

Runs the engine in this process (the default model and settings unless given; greedy, eos
ignored): one prefill pass per prompt length (the time of a 1-token generation of a fresh random
prompt, the best of three), and the decode step per batch size and context (the median of 16 engine steps
once that many prompts of that length are all decoding). The KV bytes per token
come from the engine's layout; the KV transfer bandwidth is --kv-bandwidth (default: a copy of a
64 MiB tensor measured here, the same-host ceiling; give a measured transport's figure for a real
network). Timings on a busy machine are high and noisy: say so beside them.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch

from cluster.config import EngineConfig, default_model_dir
from cluster.engine.engine import LLMEngine
from cluster.planner.costs import profile_from_dict
from cluster.types import SamplingParams


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def copy_bandwidth() -> float:
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    return 4 * src.numel() / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=REPO / "cluster" / "planner" / "cpu-default.json")
    ap.add_argument("--prefill", type=ints, default=ints("16,128,512,2048"))
    ap.add_argument("--batches", type=ints, default=ints("1,4,16,32"))
    ap.add_argument("--contexts", type=ints, default=ints("64,512"))
    ap.add_argument("--kv-bandwidth", type=float, default=None)
    ap.add_argument("--dtype", default="auto", help="the engine's --dtype")
    ap.add_argument("--quantization", default="auto", help="the engine's --quantization")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's; a local "
                                                              "cluster's workers get one each on a 2-core machine)")
    ap.add_argument("--worker-start", type=float, default=10.0, help="seconds a new worker takes to serve (assumed)")
    ap.add_argument("--switch", type=float, default=1.0, help="seconds a role switch takes (assumed)")
    args = ap.parse_args()
    config = EngineConfig(model=args.model or default_model_dir(), dtype=args.dtype, quantization=args.quantization)
    engine = LLMEngine(replace(config, num_threads=args.threads) if args.threads else config)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def run(batch: int, length: int, new_tokens: int) -> float:
        prompts = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(batch)]
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        return time.perf_counter() - t0

    run(1, 32, 4)
    prefill = [min(run(1, n, 1) for _ in range(3)) for n in args.prefill]
    for n, s in zip(args.prefill, prefill):
        print(f"prefill {n} tokens: {s * 1e3:.1f} ms ({n / s:.0f} tok/s)")
    def decode_step(batch: int, length: int) -> float:
        """The median of 16 timed steps once every sequence of the batch is decoding."""
        warm = -(-batch * length // engine.config.scheduler.max_num_batched_tokens) + 2
        for _ in range(batch):
            engine.add_request([rng.randrange(10, vocab) for _ in range(length)],
                               SamplingParams(max_tokens=warm + 20, ignore_eos=True))
        for _ in range(warm):
            engine.step()
        times = []
        for _ in range(16):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
        return statistics.median(times)

    steps = []
    for b in args.batches:
        row = [decode_step(b, c) for c in args.contexts]
        steps.append(row)
        print(f"decode batch {b}: " + ", ".join(f"ctx {c}: {s * 1e3:.1f} ms" for c, s in zip(args.contexts, row)))
    sched, layout = engine.config.scheduler, engine.transfer_layout
    settings = {"dtype": args.dtype, "quantization": args.quantization, "threads": args.threads}
    body = {"name": args.out.stem, "settings": settings, "model": str(args.model or default_model_dir().name),
            "device": "cpu",
            "prefill": {"tokens": args.prefill, "seconds": prefill},
            "decode": {"batch_sizes": args.batches, "contexts": args.contexts, "step_s": steps},
            "kv_bytes_per_token": layout.bytes_per_token(),
            "kv_transfer_bytes_per_s": args.kv_bandwidth or copy_bandwidth(),
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "kv_tokens_per_worker": engine.memory_plan.num_blocks * layout.block_size,
            "worker_start_s": args.worker_start, "switch_s": args.switch}
    profile_from_dict(body)       # refuses a malformed profile before it is written
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
