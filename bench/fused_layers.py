"""Batch-1 decode of the default model with each decoder layer as one C call (ss_decode_layer,
cluster/model/fused_layer.py) against the layer-by-layer Python calls, beside the bf16 engine:
the engines in one process, alternated, each figure the median of the rounds.

    PYTHONPATH=. python bench/fused_layers.py [--rounds 3] [--new-tokens 128]

Prompts: 64 pseudo-random token ids, greedy with ignore_eos; decode tok/s = (new - 1) tokens over
the time of the run less the time of a one-token run (the prefill).
"""
from __future__ import annotations

import argparse
import statistics
import time

from cluster.config import EngineConfig, default_model_dir
from cluster.engine.engine import LLMEngine
from cluster.model import fused_layer
from cluster.types import SamplingParams


def decode_tok_s(engine: LLMEngine, seed: int, new_tokens: int) -> float:
    prompt = [[(seed * 7919 + i * 31) % 40000 + 100 for i in range(64)]]
    t0 = time.perf_counter()
    engine.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    t1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(prompt, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True))
    return new_tokens / (time.perf_counter() - t0 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    model = default_model_dir()
    kw = {"model": model, "num_threads": 2, "dtype": "bfloat16"}
    engines = {"bf16": LLMEngine(EngineConfig(**kw)),
               "gguf": LLMEngine(EngineConfig(**kw, quantization="gguf")),
               "gguf+a8": LLMEngine(EngineConfig(**kw, quantization="gguf", quantized_activations="int8"))}
    for engine in engines.values():
        decode_tok_s(engine, 0, 8)
    runs: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        for name, engine in engines.items():
            for fused in ((True, False) if name != "bf16" else (True,)):
                fused_layer.ENABLED = fused
                best = max(decode_tok_s(engine, 10 * r + i, args.new_tokens) for i in range(2))
                runs.setdefault((name, fused), []).append(best)
    fused_layer.ENABLED = True
    base = statistics.median(runs[("bf16", True)])
    print(f"batch 1, 64-token prompts, {args.new_tokens} new tokens, {args.rounds} rounds (median)")
    print(f"{'engine':>8} {'layers':>14} {'tok/s':>7} {'vs bf16':>8}   rounds")
    for (name, fused), values in runs.items():
        med = statistics.median(values)
        how = "-" if name == "bf16" else ("one C call" if fused else "layer by layer")
        print(f"{name:>8} {how:>14} {med:7.1f} {med / base:7.2f}x   {' '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
