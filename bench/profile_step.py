"""Where an engine step's time goes: the mean decode step, then the torch profiler's table.

    python bench/profile_step.py [--model DIR|FILE.gguf] [--dtype bfloat16|float32] [--batch 8]
        [--prompt-len 256] [--threads N] [--rows 22] [--quantization none|int8|int4|gguf]

Runs the engine in this process on random prompts (greedy, eos ignored): a warm-up, the mean
decode step from t(65 tokens) - t(1 token), then 32 decode steps (and their prefill) under
torch.profiler, printed by self CPU time. The kernel plan is the engine's own (measured or cached).
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

    def run(new_tokens: int) -> float:
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        t0 = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        return time.perf_counter() - t0
    run(8)
    step = (run(65) - run(1)) / 64
    print(f"{args.dtype} {args.quantization} batch {args.batch}, {args.threads} threads: decode step {step * 1e3:.2f} ms "
          f"({args.batch / step:.0f} tok/s); plan: {engine.compute_setup().plan.describe()}")
    with profile() as prof:
        run(33)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    engine.pool.check_idle()


if __name__ == "__main__":
    main()
