"""QuantSpec's draft, variant by variant, on the default model: acceptance, tokens per verification
and decode tok/s against plain decoding, side by side in one run.

    PYTHONPATH=. python bench/quantspec_variants.py [--kv-cache-dtype int8] [--k 4] [--prompts 6]

Variants: how the draft reads the target's KV (`full`, or the int4 view of an int8 cache), its LM
head (Q8_0 as shipped, or Q4_1) and its activations (int8 per block as shipped, or float). One
engine serves them all, the draft's modules swapped between runs; plain decoding is a bf16 engine
of its own with an unquantized cache. Prompts: held-out stdlib windows of 256 tokens
(bench/speculative.py's); greedy, ignore_eos.
"""
from __future__ import annotations

import argparse
import itertools

from bench.spec_training.evaluate import heldout_windows
from bench.speculative import decode_run
from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig, default_model_dir
from cluster.engine.engine import LLMEngine
from cluster.model.quant_linear import QuantLinear
from decode.spec.speculator import make_speculator
from kernels.cpu_quant import QuantFormat, QuantizedWeight


def tokens_per_second(engine: LLMEngine, prompts, new_tokens: int) -> float:
    seconds = tokens = 0
    for p in prompts:
        _, s, t = decode_run(engine, [p], new_tokens)
        seconds += s
        tokens += t
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-dtype", default="int8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="best tok/s of N rounds")
    args = ap.parse_args()
    model = default_model_dir()
    prompts = heldout_windows(str(model), args.prompts, 256, room=1)
    plain = LLMEngine(EngineConfig(model=model, num_threads=2, dtype="bfloat16"))
    engine = LLMEngine(EngineConfig(model=model, num_threads=2, dtype="bfloat16",
                                    cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype),
                                    speculative=SpeculativeConfig(method="quantspec", num_speculative_tokens=args.k)),
                       speculator_factory=make_speculator)
    proposer = engine.speculator.proposers["quantspec"]
    draft, backend = proposer.model, proposer.passes.runner.backend
    heads = {"q8_0": draft.lm_head,
             "q4_1": QuantLinear(QuantizedWeight.quantize(engine.model.embed_tokens.weight, QuantFormat.Q4_1))}
    four_bit = [m for m in draft.modules() if isinstance(m, QuantLinear)
                and m.qweight.format in (QuantFormat.Q4_0, QuantFormat.Q4_1)]
    views = ["full", "int4"] if args.kv_cache_dtype == "int8" else ["full"]
    variants = list(itertools.product(views, heads, ("int8", "float")))
    best: dict = {}
    for eng in (plain, engine):
        decode_run(eng, prompts[:1], 8)
    for _ in range(args.repeats):
        best["plain"] = max(best.get("plain", 0.0), tokens_per_second(plain, prompts, args.new_tokens))
        for view, head, acts in variants:
            backend.int4_view = view == "int4"
            draft.lm_head = heads[head]
            for m in [*four_bit, heads["q4_1"]]:
                m.act_int8 = acts == "int8"
            draft.invalidate_fused_layers()     # the layers' C calls hold the format codes
            engine.speculator.counts.clear()
            tps = tokens_per_second(engine, prompts, args.new_tokens)
            c = engine.speculator.stats()["quantspec"]
            old = best.get((view, head, acts), (0.0,))
            best[(view, head, acts)] = (max(old[0], tps), c["accepted"] / c["drafted"], c["emitted"] / c["steps"])
    print(f"{len(prompts)} held-out prompts of 256 tokens, {args.new_tokens} new tokens, k={args.k}, bf16 target, "
          f"KV cache {args.kv_cache_dtype}; plain decoding {best['plain']:.1f} tok/s")
    print(f"{'KV view':>8} {'head':>5} {'acts':>5} {'accept':>7} {'tok/step':>8} {'tok/s':>7} {'vs plain':>8}")
    for key in variants:
        tps, accept, per_step = best[key]
        print(f"{key[0]:>8} {key[1]:>5} {key[2]:>5} {accept:7.3f} {per_step:8.2f} {tps:7.1f} "
              f"{tps / best['plain']:7.2f}x")


if __name__ == "__main__":
    main()
