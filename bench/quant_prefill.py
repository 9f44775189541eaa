"""The default model's GGUF dequantized (bf16) against its stored blocks, TTFT and batch-1 decode,
measured alternately in one process (so a busy machine's noise lands on every variant alike).

    python bench/quant_prefill.py [--model FILE.gguf] [--threads 1] [--rounds 5] [--dtype bfloat16]

Variants, all with `--dtype` activations:
  none         --quantization none: the GGUF dequantized to --dtype, torch's GEMMs (the packed path)
  gguf kernel  --quantization gguf with every pass on the quantized C kernel (before prefill-sized
               passes went to a dequantized GEMM)
  gguf         --quantization gguf as served now (cluster/model/quant_linear.py: passes of
               DENSE_MIN_ROWS rows on dequantize-then-GEMM): what `--quantization auto` picks

Per round and variant: TTFT of a fresh 512-token prompt (random ids, no prefix hit), then batch-1
decode of 64 new tokens after a 64-token prompt (decode tok/s = 63 / (t(64 tokens) - t(1 token))).
Prints the median and best of the rounds. Perplexity: bench/quant.py (`--schemes none gguf+kernel gguf`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

VARIANTS = ("none", "gguf kernel", "gguf")

from llama_cpp_compare import busy_s


def other_work(busy0: float, own0: float, wall0: float) -> float:
    """The share of the machine's cores busy with other processes since (busy0, own0, wall0)."""
    own = sum(os.times()[:2]) - own0
    return max(0.0, (busy_s() - busy0 - own) / ((time.monotonic() - wall0) * os.cpu_count()))


def main() -> None:
    from vllm_offline import prompts

    from cluster.config import CacheConfig, EngineConfig, default_model_file
    from cluster.engine.engine import LLMEngine
    from cluster.model.quant_linear import DENSE_MIN_ROWS, set_dense_rows
    from cluster.types import SamplingParams
    from kernels import cpu_ops
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    model = args.model or default_model_file()
    engines = {q: LLMEngine(EngineConfig(model=model, dtype=args.dtype, quantization=q, num_threads=args.threads,
                                         cache=CacheConfig(num_blocks=512))) for q in ("none", "gguf")}
    vocab = engines["none"].model_config.vocab_size
    runs = iter(range(1, 1 << 30))

    def timed(variant: str, prompt_len: int, new: int) -> float:
        engine = engines["none" if variant == "none" else "gguf"]
        if variant != "none":
            set_dense_rows(engine.model, None if variant == "gguf kernel" else DENSE_MIN_ROWS)
        t0 = time.perf_counter()
        engine.generate(prompts(vocab, 1, prompt_len, next(runs)), SamplingParams(max_tokens=new, ignore_eos=True))
        return time.perf_counter() - t0

    busy0, own0, wall0 = busy_s(), sum(os.times()[:2]), time.monotonic()
    ttft: dict[str, list[float]] = {v: [] for v in VARIANTS}
    decode: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:                     # warm-up: kernels built, scratch allocated
        timed(v, 512, 1)
    for _ in range(args.rounds):
        for v in VARIANTS:
            ttft[v].append(timed(v, 512, 1))
            decode[v].append(63 / max(1e-9, timed(v, 64, 64) - timed(v, 64, 1)))
    print(f"{model.name}, {args.dtype} activations, {args.threads} thread(s), {args.rounds} alternating rounds; "
          f"{cpu_ops.cpu_signature().split('|')[0]}")
    busy = other_work(busy0, own0, wall0)
    print(f"CPU busy with other work during the rounds: {busy:.0%} of the machine"
          + ("  <- not a quiet machine: compare with care" if busy > 0.2 else ""))
    print("| variant | TTFT 512 ms (median / best) | vs none | decode b1 tok/s (median / best) | vs none |")
    print("|---|---:|---:|---:|---:|")
    base_t, base_d = statistics.median(ttft["none"]), statistics.median(decode["none"])
    for v in VARIANTS:
        t, d = statistics.median(ttft[v]), statistics.median(decode[v])
        print(f"| {v} | {1e3 * t:.0f} / {1e3 * min(ttft[v]):.0f} | {t / base_t:.2f}x | {d:.1f} / {max(decode[v]):.1f} "
              f"| {d / base_d:.2f}x |")


if __name__ == "__main__":
    main()
