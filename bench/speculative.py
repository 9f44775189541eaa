"""Speculative decoding on the default model: every proposer, fixed k against dynamic lookahead,
at batch 1 and batch 8, side by side in one run.

Prompts are windows of held-out stdlib code (files with sha1(relpath) % 20 == 0). For each
configuration it reports the acceptance rate (accepted / drafted), the mean tokens emitted per
verification step (accepted + 1) and decode tokens/s relative to plain decoding measured in the
same run (decode steps only: the prefill step is excluded). Greedy outputs are checked equal to
plain decoding on the way.

    python bench/speculative.py                       # all proposers, k in 2 4 6 and auto
    python bench/speculative.py --methods ngram --ks 4 auto --batches 1
    PYTHONPATH=. python bench/speculative.py --model default --dtype bfloat16 --methods quantspec --ks 4 auto --batches 1
    PYTHONPATH=. python bench/speculative.py --model default --dtype bfloat16 --methods quantspec --kv-cache-dtype int8

`--model default` is the project's default model (SmolLM2-135M-Instruct) instead of stdlib-coder;
its bf16 verification rows may part from plain decoding after a few dozen tokens outside the
deterministic mode (README), so the greedy check counts the prompts that differ instead of failing.
"""
from __future__ import annotations

import argparse
import time

import torch

from cluster.config import (DEFAULT_EAGLE_DIR, STDLIB_CODER_DIR, CacheConfig, EngineConfig, SpeculativeConfig,
                            default_model_dir)
from cluster.engine.engine import LLMEngine
from bench.spec_training.evaluate import heldout_windows
from cluster.types import SamplingParams
from decode.spec.speculator import make_speculator


def decode_run(engine: LLMEngine, prompts, new_tokens: int) -> tuple[list[list[int]], float, int]:
    """Outputs, seconds spent in decode steps, tokens those steps produced."""
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    outs = {rid: [] for rid in ids}
    seconds, tokens, first_seen = 0.0, 0, set()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        prefill_step = any(d.request_id not in first_seen for d in deltas if d.token_ids)
        for d in deltas:
            outs[d.request_id].extend(d.token_ids)
            n = len(d.token_ids) - (0 if d.request_id in first_seen else 1)
            first_seen.add(d.request_id)
            if not prefill_step:
                tokens += n
        if not prefill_step:
            seconds += dt
    return [outs[r] for r in ids], seconds, tokens


def run_all(engine: LLMEngine, groups, new_tokens: int, repeats: int) -> tuple[list[list[int]], float]:
    """All prompt groups, best decode tokens/s of `repeats` runs (acceptance counts add up)."""
    best, outs = 0.0, []
    for _ in range(repeats):
        outs, secs, toks = [], 0.0, 0
        for g in groups:
            o, s, t = decode_run(engine, g, new_tokens)
            outs += o
            secs += s
            toks += t
        best = max(best, toks / secs)
    return outs, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["ngram", "draft", "eagle"])
    ap.add_argument("--ks", nargs="+", default=["2", "4", "6", "auto"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs per configuration (noise)")
    ap.add_argument("--model", default=None, help="a model directory, or 'default' (default: stdlib-coder)")
    ap.add_argument("--dtype", default="auto", help="the engines' --dtype (auto: the checkpoint's)")
    ap.add_argument("--deterministic", action="store_true", help="every engine in the batch-invariant mode "
                                                                 "(greedy output equal to plain decoding, bf16 too)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the speculative engines' KV cache (int8: quantspec's hierarchical cache); plain "
                         "decoding, the baseline, keeps the model's dtype")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = STDLIB_CODER_DIR if args.model is None else default_model_dir() if args.model == "default" else args.model
    prompts = heldout_windows(str(model), args.prompts, args.prompt_len, room=1)
    methods = [m for m in args.methods if m != "eagle" or DEFAULT_EAGLE_DIR.is_dir()]
    engines = {"off": LLMEngine(EngineConfig(model=model, num_threads=args.threads, dtype=args.dtype,
                                             deterministic=args.deterministic),
                                speculator_factory=make_speculator)}
    for m in methods:
        engines[m] = LLMEngine(EngineConfig(model=model, num_threads=args.threads, dtype=args.dtype,
                                            deterministic=args.deterministic, cache=CacheConfig(kv_cache_dtype=args.kv_cache_dtype),
                                            speculative=SpeculativeConfig(method=m)), speculator_factory=make_speculator)
    print(f"{len(prompts)} held-out prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"{args.threads} threads, {next(iter(engines.values())).dtype}, speculative engines' KV cache "
          f"{args.kv_cache_dtype}{', deterministic mode' if args.deterministic else ''}")
    print(f"{'batch':>5} {'method':>6} {'k':>4} {'accept':>7} {'tok/step':>8} {'tok/s':>8} {'vs plain':>8}")
    for batch in args.batches:
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        for eng in engines.values():          # warm up every engine at this batch size
            decode_run(eng, groups[0], 8)
        plain_out, base = run_all(engines["off"], groups, args.new_tokens, args.repeats)
        print(f"{batch:>5} {'off':>6} {'-':>4} {'-':>7} {'1.00':>8} {base:8.1f} {'1.00x':>8}")
        for m in methods:
            for k in args.ks:
                eng = engines[m]
                eng.speculator.config = SpeculativeConfig(method=m, num_speculative_tokens=k if k == "auto" else int(k))
                eng.speculator.counts.clear()
                outs, rate_tps = run_all(eng, groups, args.new_tokens, args.repeats)
                differ = sum(o != p for o, p in zip(outs, plain_out))
                if args.model is None:
                    assert not differ, f"{m} k={k}: greedy output differs from plain decoding"
                c = eng.speculator.stats().get(m, {"drafted": 0, "accepted": 0, "steps": 0, "emitted": 0})
                rate = c["accepted"] / max(c["drafted"], 1)
                per_step = c["emitted"] / max(c["steps"], 1)
                print(f"{batch:>5} {m:>6} {k:>4} {rate:7.3f} {per_step:8.2f} {rate_tps:8.1f} "
                      f"{rate_tps / base:7.2f}x" + (f"  ({differ} of {len(outs)} part from plain)" if differ else ""),
                      flush=True)


if __name__ == "__main__":
    main()
