"""Decode steps on the default model's GGUF blocks at batch 1-64: the quantized kernel, its bf16 dot
path and the dequantized GEMM, against the bf16 model; and a 512-token TTFT for each.

    python bench/quant_batch.py [--batches 1 4 8 16 32 64] [--rounds 3]

One thread, timed with `time.thread_time` (CPU of this thread: a busy machine's other work does not
count; the engine runs its passes in the calling thread). Variants, bf16 activations:
  none     --quantization none: the GGUF dequantized to bf16 once, oneDNN's packed GEMM
  kernel   --quantization gguf, every pass on quant.c's kernel (decoded in registers, fp32 FMAs);
           what the deterministic mode runs
  dot      every bf16 pass on quant_dot.c (the tile decoded to bf16 in L1, vdpbf16ps; 32+ rows: the C
           threshold Q_DOT_MIN_ROWS, below it the kernel)
  dense    every pass dequantized whole to bf16, then torch's GEMM
  served   what `--quantization auto` serves now: kernel below 32 rows, dot to 127, dense from 128
A decode step: (t(17 new tokens) - t(1)) / 16 after 64-token prompts, the median of --rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

VARIANTS = ("none", "kernel", "dot", "dense", "served")


def main() -> None:
    import torch
    from vllm_offline import prompts

    from cluster.config import CacheConfig, EngineConfig, default_model_file
    from cluster.engine.engine import LLMEngine
    from cluster.model.quant_linear import DENSE_MIN_ROWS, QuantLinear
    from cluster.types import SamplingParams
    from kernels import cpu_ops
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engines = {q: LLMEngine(EngineConfig(model=default_model_file(), dtype="bfloat16", quantization=q, num_threads=1,
                                         cache=CacheConfig(num_blocks=2048))) for q in ("none", "gguf")}
    vocab = engines["none"].model_config.vocab_size
    seeds = iter(range(1, 1 << 30))
    switches = {"kernel": (None, False), "dot": (1 << 30, True), "dense": (1, False), "served": (DENSE_MIN_ROWS, True)}

    def engine(variant: str) -> LLMEngine:
        if variant == "none":
            return engines["none"]
        e = engines["gguf"]
        for m in e.model.modules():
            if isinstance(m, QuantLinear):
                m.dense_rows, m.bf16_dot = switches[variant]
        e.model.invalidate_fused_layers()   # the one-call layers carry the dot switch in their format codes
        return e

    def cpu_s(variant: str, batch: int, prompt_len: int, new: int) -> float:
        e = engine(variant)
        batch_prompts = prompts(vocab, batch, prompt_len, next(seeds))
        t0 = time.thread_time()
        e.generate(batch_prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        return time.thread_time() - t0

    def step_ms(variant: str, batch: int) -> float:
        return (cpu_s(variant, batch, 64, 17) - cpu_s(variant, batch, 64, 1)) / 16 * 1e3

    print(f"{default_model_file().name}, bf16 activations, 1 thread (CPU time); {cpu_ops.cpu_signature().split('|')[0]}; "
          f"bf16 dot built: {cpu_ops.has_bf16_dot()}")
    for v in VARIANTS:
        cpu_s(v, 1, 512, 1)
    ttft = {v: statistics.median(cpu_s(v, 1, 512, 1) for _ in range(args.rounds)) * 1e3 for v in VARIANTS}
    print("| decode step ms | " + " | ".join(VARIANTS) + " |")
    print("|---:|" + "---:|" * len(VARIANTS))
    print("| TTFT 512 | " + " | ".join(f"{ttft[v]:.0f}" for v in VARIANTS) + " |")
    for b in args.batches:
        for v in VARIANTS:
            step_ms(v, b)
        steps = {v: statistics.median(step_ms(v, b) for _ in range(args.rounds)) for v in VARIANTS}
        print(f"| batch {b} | " + " | ".join(f"{steps[v]:.1f}" for v in VARIANTS) + " |", flush=True)


if __name__ == "__main__":
    main()
