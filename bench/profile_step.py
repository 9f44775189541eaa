"""Where an engine step's time goes: the mean decode step, then the torch profiler's table.

    python bench/profile_step.py [--model DIR|FILE.gguf] [--dtype bfloat16|float32] [--batch 8]
        [--prompt-len 256] [--threads N] [--rows 22] [--quantization none|int8|int4|gguf]
        [--sweep 1,2,4,8,16,32,64]

Runs the engine in this process on random prompts (greedy, eos ignored): a warm-up, the mean
decode step from t(65 tokens) - t(1 token), then 32 decode steps (and their prefill) under
torch.profiler, printed by self CPU time. The kernel plan is the engine's own (measured or cached).
`--sweep B1,B2,...`: instead, the mean decode step at each batch size and its cost over batch 1's
(what the fair scheduler's contended step budget is chosen from: `--fair-step-tokens`).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "cluster" / "model" / "weights" / "stdlib-coder")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--sweep", default=None, help="comma-separated batch sizes: the decode step at each, no profile")
    ap.add_argument("--quantization", default="none", help="the engine's --quantization (gguf: a .gguf --model)")
    args = ap.parse_args()
    from torch.profiler import profile

    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                    quantization=args.quantization, cache=CacheConfig(memory_budget_bytes=4 << 30),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=4096)))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def run(new_tokens: int, batch: int = args.batch) -> float:
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        return time.perf_counter() - t0
    run(8)
    if args.sweep:
        sweep(run, [int(b) for b in args.sweep.split(",")])
        return
    step = (run(65) - run(1)) / 64
    print(f"{args.dtype} {args.quantization} batch {args.batch}, {args.threads} threads: decode step {step * 1e3:.2f} ms "
          f"({args.batch / step:.0f} tok/s); plan: {engine.compute_setup().plan.describe()}")
    with profile() as prof:
        run(33)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    engine.pool.check_idle()


def sweep(run, batches: list[int]) -> None:
    """The mean decode step per batch size, from t(33 tokens) - t(1 token) (best of two)."""
    base = None
    for batch in batches:
        step = min((run(33, batch) - run(1, batch)) / 32 for _ in range(2))
        base = base or step
        print(f"batch {batch:3d}: decode step {step * 1e3:7.2f} ms, {step / base:5.2f}x batch {batches[0]}, "
              f"{step / batch * 1e3:6.2f} ms per row", flush=True)


if __name__ == "__main__":
    main()
