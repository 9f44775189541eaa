"""Prefill attention on CPUs: the C kernel (kernels/cpu/prefill_attn.c) against torch's SDPA, as a
kernel and inside the engine's prefill, measured alternately in one process.

    python bench/prefill_attention.py [--threads 1] [--rounds 5] [--dtype bfloat16] [--skip-engine]

1. The kernel alone, causal, SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim
   64), 128 / 512 / 2048 tokens: ms per call and GFLOP/s (causal half of the score and value
   products), C over SDPA. One thread is timed with thread_time (a busy machine's other work does
   not count), more with wall time.
2. The engine: TTFT of one fresh 512-token prompt and of eight at once (prefill tok/s), the default
   model at --dtype, the plan resolved as served, with its prefill attention on SDPA and on C
   (one thread: this thread's CPU time, as above).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

import torch
import torch.nn.functional as F
from quant_prefill import busy_s, other_work

HQ, HKV, DIM = 9, 3, 64


def _clock():
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _ms(fn, calls: int) -> float:
    fn()
    t0 = _clock()
    for _ in range(calls):
        fn()
    return (_clock() - t0) / calls * 1e3


def kernel_table(dtype: torch.dtype, rounds: int) -> None:
    from kernels import cpu_ops
    print(f"| tokens | SDPA ms | C ms | SDPA GFLOP/s | C GFLOP/s | C vs SDPA |  ({dtype}, {torch.get_num_threads()} thread(s))")
    print("|---:|---:|---:|---:|---:|---:|")
    for ctx in (128, 512, 2048):
        qkv = torch.randn(ctx, (HQ + 2 * HKV) * DIM).to(dtype)
        q = qkv[:, :HQ * DIM].view(ctx, HQ, DIM)
        k = qkv[:, HQ * DIM:(HQ + HKV) * DIM].view(ctx, HKV, DIM)
        v = qkv[:, (HQ + HKV) * DIM:].view(ctx, HKV, DIM)

        def sdpa(q=q, k=k, v=v):
            heads = [t.transpose(0, 1)[None] for t in (q, k, v)]
            return F.scaled_dot_product_attention(*heads, is_causal=True, scale=DIM ** -0.5, enable_gqa=True)

        def c(q=q, k=k, v=v):
            return cpu_ops.prefill_attention(q, k, v, None, DIM ** -0.5)

        calls = max(2, 4096 // ctx) * rounds
        ts = statistics.median(_ms(sdpa, calls) for _ in range(3))
        tc = statistics.median(_ms(c, calls) for _ in range(3))
        gflop = 2 * 2 * HQ * ctx * ctx / 2 * DIM / 1e9
        print(f"| {ctx} | {ts:.2f} | {tc:.2f} | {gflop / ts * 1e3:.0f} | {gflop / tc * 1e3:.0f} | {ts / tc:.2f}x |")


def engine_table(dtype: str, threads: int, rounds: int) -> None:
    from vllm_offline import prompts

    from cluster.config import CacheConfig, EngineConfig, default_model_file
    from cluster.engine.engine import LLMEngine
    from cluster.model.kernel_choice import resolved_engine_config
    from cluster.model.kernel_plan import AttentionPath
    from cluster.types import SamplingParams
    base = resolved_engine_config(EngineConfig(model=default_model_file(), dtype=dtype, num_threads=threads,
                                               cache=CacheConfig(num_blocks=1024)), threads)
    plans = {"SDPA": replace(base.kernel_plan, prefill_attention=AttentionPath.SDPA),
             "C": replace(base.kernel_plan, prefill_attention=AttentionPath.FUSED_C)}
    engines = {name: LLMEngine(replace(base, kernel_plan=plan)) for name, plan in plans.items()}
    vocab = engines["C"].model_config.vocab_size
    seeds = iter(range(1, 1 << 30))

    def ttft(name: str, batch: int) -> float:   # CPU time of this thread with one thread (see the top)
        t0 = _clock()
        engines[name].generate(prompts(vocab, batch, 512, next(seeds)), SamplingParams(max_tokens=1, ignore_eos=True))
        return _clock() - t0

    for name in engines:
        ttft(name, 1)
    runs = {(name, b): [] for name in engines for b in (1, 8)}
    for _ in range(rounds):
        for name in engines:
            for b in (1, 8):
                runs[(name, b)].append(ttft(name, b))
    print(f"\nEngine prefill, {base.model.name} at {dtype} (quantization {base.quantization}), {threads} thread(s), "
          f"{rounds} alternating rounds (median):")
    print("| prefill attention | TTFT 1 x 512 ms | prefill tok/s 8 x 512 | vs SDPA |")
    print("|---|---:|---:|---:|")
    for name in engines:
        t1, t8 = statistics.median(runs[(name, 1)]), statistics.median(runs[(name, 8)])
        print(f"| {name} | {t1 * 1e3:.0f} | {8 * 512 / t8:.0f} | "
              f"{statistics.median(runs[('SDPA', 1)]) / t1:.2f}x / {statistics.median(runs[('SDPA', 8)]) / t8:.2f}x |")


def main() -> None:
    from kernels import cpu_ops
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_ops.load() is None or not cpu_ops.has_prefill_attention():
        sys.exit("the C prefill attention is built only with AVX-512: nothing to compare on this CPU")
    busy0, own0, wall0 = busy_s(), sum(os.times()[:2]), time.monotonic()
    print(cpu_ops.cpu_signature().split("|")[0])
    kernel_table(getattr(torch, args.dtype), args.rounds)
    if not args.skip_engine:
        engine_table(args.dtype, args.threads, args.rounds)
    busy = other_work(busy0, own0, wall0)
    print(f"CPU busy with other work: {busy:.0%} of the machine" + ("  <- not quiet: wall times are upper bounds"
                                                                   if busy > 0.2 else ""))


if __name__ == "__main__":
    main()
