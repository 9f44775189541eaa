"""Tensor parallelism on this machine: TP 2 (two rank processes, one core each) against TP 1 with 2
threads, on the default model in its weights' dtype (--quantization none: TP shards unquantized
weights): decode steps at batch 1 and 8, a 512-token prefill, and what one all-reduce of the
hidden states costs (two per layer) between two gloo processes pinned to their own cores.

    PYTHONPATH=. python bench/tp.py [--rounds 3] [--dtype auto]
    PYTHONPATH=. python bench/tp.py --moe [--rounds 2]   # experts sliced (TP) against placed whole (EP)

--moe: bench/moe.py's Qwen3-30B-A3B shape cut to 4 layers (64 experts of 384, top-8, hidden 1024;
random weights, built once in /tmp), both at TP 2: decode at batch 8 and a 512-token prefill.

A benchmark, not a test: the figures depend on what else runs (the share of the machine busy with
other work is printed beside them). On 2 cores TP mostly shows the collectives' cost.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))
sys.path.append(str(REPO / "tests"))

from llama_cpp_compare import busy_s

from cluster.config import EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams

DECODE_STEPS = 24
ROWS = (1, 8, 512)


def tree_cpu_s() -> float:
    """CPU seconds of this process and its children (the follower ranks), live ones included."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def decode_ms(engine: LLMEngine, batch: int, seed: int) -> float:
    """Milliseconds per decode step with `batch` sequences running (after their prefill)."""
    sampling = SamplingParams(max_tokens=DECODE_STEPS + 2, ignore_eos=True)
    for p in prompts(engine.model_config.vocab_size, batch, 16, seed):
        engine.add_request(p, sampling)
    while any(s.num_output_tokens < 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    t0 = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return 1e3 * elapsed / DECODE_STEPS


def prefill_ms(engine: LLMEngine, seed: int) -> float:
    t0 = time.perf_counter()
    engine.generate(prompts(engine.model_config.vocab_size, 1, 512, seed), SamplingParams(max_tokens=1))
    return 1e3 * (time.perf_counter() - t0)


def _all_reduce_rank(rank: int, port: int, hidden: int, dtype: torch.dtype, out) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    for rows in ROWS:
        t = torch.randn(rows, hidden).to(dtype)
        for _ in range(20):
            dist.all_reduce(t)
        n = 200 if rows < 512 else 40
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        if rank == 0:
            out[rows] = 1e6 * (time.perf_counter() - t0) / n
    dist.destroy_process_group()


def all_reduce_us(hidden: int, dtype: torch.dtype) -> dict[int, float]:
    """Microseconds of one all-reduce of [rows, hidden] between two pinned gloo processes."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_all_reduce_rank, args=(29000 + os.getpid() % 1000, hidden, dtype, out), nprocs=2)
        return dict(out)


def measure(engine: LLMEngine, rounds: int) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {"decode b1": [], "decode b8": [], "prefill 512": []}
    decode_ms(engine, 1, 0)        # warm-up
    for r in range(rounds):
        figures["decode b1"].append(decode_ms(engine, 1, 10 + r))
        figures["decode b8"].append(decode_ms(engine, 8, 20 + r))
        figures["prefill 512"].append(prefill_ms(engine, 30 + r))
    return figures


def moe_checkpoint(dtype: torch.dtype) -> Path:
    import transformers
    from moe import COMMON, MOE
    from tiny_models import make_tokenizer
    out = Path(f"/tmp/splitserve-bench-tp-moe-{str(dtype).removeprefix('torch.')}")
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        cfg = transformers.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 4}, **MOE)
        model = transformers.Qwen3MoeForCausalLM(cfg).to(dtype)
        model.generation_config.eos_token_id = 1
        model.save_pretrained(out)
        make_tokenizer(out, bos=True)
    return out


def moe_main(args) -> None:
    model = moe_checkpoint(torch.bfloat16 if args.dtype in ("auto", "bfloat16") else torch.float32)
    busy0, own0, wall0 = busy_s(), tree_cpu_s(), time.monotonic()
    results = {}
    for name, ep in (("TP (experts sliced)", False), ("EP (experts whole)", True)):
        engine = LLMEngine(EngineConfig(model=model, quantization="none", dtype=args.dtype, num_threads=2,
                                        tensor_parallel_size=2, enable_expert_parallel=ep,
                                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024)))
        decode_ms(engine, 8, 0)
        results[name] = ([decode_ms(engine, 8, 20 + r) for r in range(args.rounds)],
                         [prefill_ms(engine, 30 + r) for r in range(args.rounds)])
        own0 -= tree_cpu_s()
        engine.close()
        own0 += tree_cpu_s()
        dtype = str(engine.dtype).removeprefix("torch.")
    other = max(0.0, (busy_s() - busy0 - (tree_cpu_s() - own0)) / ((time.monotonic() - wall0) * os.cpu_count()))
    print(f"Qwen3-MoE shape, 4 layers, 64 experts top-8, {dtype}; TP 2 (1 core a rank); {args.rounds} rounds, medians")
    print(f"CPU busy with other work during the rounds: {other:.0%} of the machine"
          + ("  <- not a quiet machine: compare with care" if other > 0.2 else ""))
    print("| experts | decode b8 ms a step | prefill 512 ms |")
    print("|---|---:|---:|")
    for name, (dec, pre) in results.items():
        print(f"| {name} | {statistics.median(dec):.1f} | {statistics.median(pre):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--moe", action="store_true", help="experts sliced against placed whole, at TP 2")
    args = parser.parse_args()
    if args.moe:
        moe_main(args)
        return
    base = EngineConfig(quantization="none", dtype=args.dtype, scheduler=SchedulerConfig(max_num_seqs=16))
    busy0, own0, wall0 = busy_s(), tree_cpu_s(), time.monotonic()
    results = {}
    for tp in (1, 2):
        cfg = EngineConfig(model=base.model, quantization="none", dtype=args.dtype, scheduler=base.scheduler,
                           num_threads=2, tensor_parallel_size=tp)
        engine = LLMEngine(cfg)
        results[tp] = measure(engine, args.rounds)
        own0 -= tree_cpu_s()        # the followers' CPU time leaves with them: count it before they go
        engine.close()
        own0 += tree_cpu_s()
        mc, dtype = engine.model_config, engine.dtype
    other = max(0.0, (busy_s() - busy0 - (tree_cpu_s() - own0)) / ((time.monotonic() - wall0) * os.cpu_count()))
    reduce_us = all_reduce_us(mc.hidden_size, dtype)
    layers = mc.num_layers
    print(f"{base.model.name}, {str(dtype).removeprefix('torch.')}, {layers} layers, hidden {mc.hidden_size}; "
          f"TP 1: 2 threads; TP 2: 2 ranks pinned to 1 core each (gloo); {args.rounds} rounds, medians")
    print(f"CPU busy with other work during the rounds: {other:.0%} of the machine"
          + ("  <- not a quiet machine: compare with care" if other > 0.2 else ""))
    print("| pass | TP 1 ms | TP 2 ms | TP 2 / TP 1 | all-reduces of the pass (2 a layer + embedding) |")
    print("|---|---:|---:|---:|---:|")
    for name, rows in (("decode b1", 1), ("decode b8", 8), ("prefill 512", 512)):
        t1, t2 = statistics.median(results[1][name]), statistics.median(results[2][name])
        print(f"| {name} | {t1:.1f} | {t2:.1f} | {t2 / t1:.2f}x | {(2 * layers + 1) * reduce_us[rows] / 1e3:.1f} ms |")
    print("one all-reduce of [rows, hidden] between two pinned gloo processes: "
          + ", ".join(f"{rows} rows {us:.0f} us" for rows, us in sorted(reduce_us.items())))


if __name__ == "__main__":
    main()
