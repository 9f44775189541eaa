"""Less KV per token, quality and memory and speed together: attention sinks with a window
(cluster/kv/window.py) against full attention and a plain window, on the default model.

    python bench/kv_compress.py [--tokens 4096] [--contexts 2] [--window 1024] [--sinks 4]
                                [--gen-tokens 20000] [--json out.json]

Quality: held-out text (this repository's README.md and docs/*.md, which no model's training or
our tuning saw) cut into --contexts contexts of --tokens tokens; every token from the second on
is scored (`prompt_logprobs`) with full attention, a plain window (no sinks) and window + sinks;
perplexity over all tokens and over the tokens past the window (positions >= window + sinks,
where the window drops something). Memory and speed: one windowed request generates
--gen-tokens tokens (greedy, past the model's context when asked) while every step's blocks in
use are recorded; decode speed per 1,000 tokens. Full attention's decode speed over the same
prompt for --full-gen-tokens tokens for comparison. Prints "CPU busy with other work": figures
taken on a busy machine are upper bounds on time.

KV compaction of long prompts, served (cluster/engine/compaction.py), with --compaction-ratios:

    python bench/kv_compress.py --compaction-ratios 2,4,8 [--tokens 2048] [--continuation 256]
                                [--contexts 3] [--recent 128] [--observe 32] [--json out.json]

Each held-out context of --tokens + --continuation tokens runs through the engine as a request
whose prompt is the first --tokens and whose continuation is forced to the text's (each sampled
token replaced by the true one before it is computed), scoring every continuation token from the
logits the engine sampled from: the continuation perplexity of decoding on the compacted cache,
through the served path (capture, selection, gather, the offset layout, the decode kernels).
KV bytes kept = the blocks the request holds when its prefill ends (what a P/D handoff moves).
TTFT: one prompt alone, prefix cache emptied, max_tokens 1 (the compaction included), best of
--ttft-repeats rounds that interleave the settings. --compaction-methods select,fit adds fitted values.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

from llama_cpp_compare import busy_s
from quant_prefill import other_work


def held_out(tokenizer, n: int, size: int) -> list[list[int]]:
    docs = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "kv_compress.md"]   # not its own figures
    text = "\n\n".join(p.read_text() for p in [REPO / "README.md", *docs])
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    step = max(size, (len(ids) - size) // max(1, n - 1))
    return [ids[i:i + size] for i in range(0, len(ids) - size + 1, step)][:n]


def perplexities(engine, contexts, kv_window: int, sinks: int, past: int) -> dict:
    from cluster.types import SamplingParams
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, kv_window=kv_window, kv_sink_tokens=sinks)
    start = time.perf_counter()
    outs = engine.generate(contexts, sp)
    seconds = time.perf_counter() - start
    every, late = [], []
    for o in outs:
        for pos, lp in enumerate(o.prompt_logprobs, start=1):   # lp scores the token at position pos
            every.append(-lp.logprob)
            if pos >= past:
                late.append(-lp.logprob)
    return {"ppl": math.exp(sum(every) / len(every)), "ppl_past_window": math.exp(sum(late) / len(late)),
            "scored": len(every), "scored_past_window": len(late), "seconds": round(seconds, 1)}


def generate_long(engine, prompt: list[int], n: int, kv_window: int | None, sinks: int,
                  time_limit: float = float("inf")) -> dict:
    """One request of n greedy tokens (aborted after `time_limit` seconds: a busy machine):
    blocks in use per step, tokens/s per 1,000 tokens."""
    from cluster.types import SamplingParams
    sp = SamplingParams(max_tokens=n, ignore_eos=True, kv_window=kv_window, kv_sink_tokens=sinks)
    engine.add_request(prompt, sp, request_id="long")
    most, tokens, marks, t0 = 0, 0, [], time.perf_counter()
    last, reason = t0, None
    while engine.has_unfinished():
        for d in engine.step():
            tokens += len(d.token_ids)
            reason = d.finish_reason or reason
        most = max(most, engine.pool.num_used)
        if time.perf_counter() - t0 > time_limit and reason is None:
            engine.abort("long")
        if tokens >= 1000 * (len(marks) + 1):
            now = time.perf_counter()
            marks.append(round(1000 / (now - last), 1))
            last = now
    engine.pool.check_idle()
    return {"tokens": tokens, "finish": str(reason), "max_blocks_in_use": most,
            "tok_s_per_1000": marks, "positions_reached": len(prompt) + tokens, "seconds": round(time.perf_counter() - t0, 1)}


def forced_continuation(engine, ids: list[int], prompt: int, spec) -> tuple[float, int, int]:
    """(summed NLL, tokens scored, blocks held when the prefill ended) of `ids[prompt:]` decoded
    on `ids[:prompt]`'s cache (compacted by `spec`, or None), the true tokens forced in."""
    from cluster.types import SamplingParams
    seq = engine.sequence(engine.add_request(ids[:prompt], SamplingParams(
        max_tokens=len(ids) - prompt, ignore_eos=True, kv_compaction=spec)))
    rows, execute = [], engine.runner.execute

    def scored(plan):     # the logits row the engine samples this sequence's next token from
        out = execute(plan)
        rows.extend(out.logits[i].float().log_softmax(-1) for i, s in enumerate(out.sampled) if s is seq)
        return out
    engine.runner.execute, held = scored, None
    try:
        while engine.has_unfinished():
            engine.step()
            k = seq.num_tokens - prompt
            held = len(seq.block_ids) if held is None and k > 0 else held
            if k > 0 and not seq.is_finished:
                seq.token_ids[-1] = ids[prompt + k - 1]     # the true token, before its KV is computed
    finally:
        engine.runner.execute = execute
    nll = -sum(float(r[t]) for r, t in zip(rows, ids[prompt:]))
    return nll, len(rows), held


def ttfts(engine, prompt: list[int], specs: dict, repeats: int) -> tuple[dict, dict]:
    """Best TTFT, and best time in the compaction itself, per spec (prefix cache emptied, max_tokens 1: the compaction included), the specs
    interleaved in each round so that a busy machine's swings fall on all of them."""
    from cluster.types import SamplingParams
    best, compacting = dict.fromkeys(specs, float("inf")), {}
    for _ in range(repeats):
        for name, spec in specs.items():
            engine.pool.reset_prefix_cache()
            t0, c0 = time.perf_counter(), engine.compactor.seconds
            engine.generate([prompt], SamplingParams(max_tokens=1, kv_compaction=spec))
            best[name] = min(best[name], time.perf_counter() - t0)
            compacting[name] = min(compacting.get(name, float("inf")), engine.compactor.seconds - c0)
    return best, compacting


def compaction_figures(engine, args) -> dict:
    from cluster.types import KVCompaction
    contexts = held_out(engine.tokenizer, args.contexts, args.tokens + args.continuation)
    per_block = engine.layout.bytes_per_block()
    specs = {"full": None, **{f"{m} x{r:g}": KVCompaction(ratio=r, method=m, recent=args.recent, observe=args.observe)
                              for m in args.compaction_methods for r in args.compaction_ratios}}
    times, compacting = ttfts(engine, contexts[0][:args.tokens], specs, args.ttft_repeats)
    out = {}
    for name, spec in specs.items():
        r = {"ttft_s": round(times[name], 3), "ttft_vs_full": times[name] / times["full"],
             "compaction_s": round(compacting[name], 3)}
        if not args.skip_quality:
            nll, count, held = 0.0, 0, 0
            for ids in contexts:
                a, b, h = forced_continuation(engine, ids, args.tokens, spec)
                nll, count, held = nll + a, count + b, max(held, h)
            r.update(ppl=math.exp(nll / count), scored=count, kv_blocks_held=held, kv_bytes_held=held * per_block)
            r["ppl_vs_full"] = r["ppl"] / out.get("full", r)["ppl"] - 1
            r["bytes_vs_full"] = r["kv_bytes_held"] / out.get("full", r)["kv_bytes_held"]
            print(f"{name:>10}: continuation perplexity {r['ppl']:.3f} ({100 * r['ppl_vs_full']:+.1f}%), KV held/moved "
                  f"{held} blocks = {r['kv_bytes_held'] / 2**20:.2f} MiB ({r['bytes_vs_full']:.0%})")
        print(f"{name:>10}: TTFT {r['ttft_s']:.2f} s ({r['ttft_vs_full']:.2f}x), of which compaction "
              f"{r['compaction_s']:.3f} s", flush=True)
        out[name] = r
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--contexts", type=int, default=2)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--gen-tokens", type=int, default=20000)
    p.add_argument("--full-gen-tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--time-limit", type=float, default=float("inf"),
                   help="seconds the windowed generation may take (then aborted: its figures so far)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--compaction-ratios", type=lambda t: [float(r) for r in t.split(",")], default=None,
                   help="measure KV compaction (select) at these ratios instead of the window")
    p.add_argument("--compaction-methods", type=lambda t: t.split(","), default=["select"])
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--recent", type=int, default=128)
    p.add_argument("--observe", type=int, default=32)
    args = p.parse_args()
    from cluster.config import (
        CacheConfig,
        EngineConfig,
        default_model_dir,
        resolve_model,
    )
    from cluster.engine.engine import LLMEngine
    model = resolve_model(args.model) if args.model else default_model_dir()
    busy0, own0, wall0 = busy_s(), sum(os.times()[:2]), time.monotonic()
    cache = CacheConfig(kv_window=args.window, kv_sink_tokens=args.sinks,
                        kv_window_max_positions=args.gen_tokens + 1024)
    if args.compaction_ratios:
        cache = CacheConfig()
    engine = LLMEngine(EngineConfig(model=model, num_threads=args.threads, cache=cache))
    if args.compaction_ratios:
        result = {"model": model.name, "dtype": str(engine.layout.dtype), "block_size": engine.layout.block_size,
                  "tokens": args.tokens,
                  "continuation": args.continuation, "contexts": args.contexts,
                  "compaction": compaction_figures(engine, args)}
        return _done(result, args, busy0, own0, wall0)
    bs = engine.layout.block_size
    result = {"model": model.name, "window": args.window, "sinks": args.sinks, "block_size": bs,
              "kv_bytes_per_block": engine.layout.bytes_per_block()}
    contexts = held_out(engine.tokenizer, args.contexts, args.tokens)
    if not args.skip_quality:
        past = args.window + args.sinks
        result["quality"] = {name: perplexities(engine, contexts, w, s, past) for name, w, s in (
            ("full", 0, 0), ("window", args.window, 0), ("window+sinks", args.window, args.sinks))}
        for name, q in result["quality"].items():
            print(f"{name:>13}: perplexity {q['ppl']:.3f}, past the window {q['ppl_past_window']:.3f} "
                  f"({q['scored_past_window']} of {q['scored']} tokens), {q['seconds']} s")
        full = result["quality"]["full"]["ppl_past_window"]
        for name in ("window", "window+sinks"):
            rel = result["quality"][name]["ppl_past_window"] / full - 1
            print(f"{name:>13}: past the window {100 * rel:+.1f}% against full attention")
    prompt = contexts[0][:256]
    result["full_decode"] = generate_long(engine, prompt, args.full_gen_tokens, 0, 0)
    result["windowed_decode"] = generate_long(engine, prompt, args.gen_tokens, args.window, args.sinks,
                                              args.time_limit)
    bound = -(-args.sinks // bs) + -(-args.window // bs) + 1
    for name in ("full_decode", "windowed_decode"):
        r = result[name]
        print(f"{name}: {r['tokens']} tokens ({r['finish']}), at most {r['max_blocks_in_use']} blocks in use "
              f"(window bound {bound}), tok/s per 1,000: {r['tok_s_per_1000']}, {r['seconds']} s")
    return _done(result, args, busy0, own0, wall0)


def _done(result: dict, args, busy0, own0, wall0) -> int:
    result["busy"] = round(other_work(busy0, own0, wall0), 2)
    print(f"CPU busy with other work: {result['busy']:.0%} of the machine during the run"
          + ("  <- not quiet: times are upper bounds" if result["busy"] > 0.2 else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
