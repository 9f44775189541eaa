"""Quantized weights and KV cache on the default model: memory, latency and quality in one table.

    python bench/quant.py [--model DIR|FILE.gguf] [--schemes none int8 int4 gguf none/int8 ...] [--threads 2]
                          [--rounds 3]

A scheme is WEIGHTS or WEIGHTS/KV: `--quantization` (cluster/model/quantize.py), `+a8` after it
for `--quantized-activations int8` (gguf+a8, int4+a8), `+kernel` for every pass on the quantized
kernel (prefill too, as before passes of many rows went to a dequantized GEMM:
cluster/model/quant_linear.py's DENSE_MIN_ROWS), and after the slash `--kv-cache-dtype`
(cluster/kv/kv_quant.py; auto when omitted). Each is built in a child
process of its own (one engine's memory never hides behind another's), bfloat16 activations, the
engine's default kernel plan. Per scheme:

  weight MiB       the model's resident bytes but the embedding table: the linear layers as held
                   (quantized blocks and scales, or bf16; a tied LM head quantized is counted here)
  resident MiB     every parameter and buffer of the model (the embedding table included)
  decode tok/s     batch 1 and 8, 64-token prompts, 64 new tokens, greedy, ignore_eos
                   (bench/vllm_offline.py's `measure`: best of --repeats after a warm-up); and
                   batch 8 after 1,024-token prompts ("b8@1k"), where reading the KV weighs more
  TTFT ms          one 512-token prompt to its first token
  perplexity       held-out text (this repository's docs, bench/perplexity.py's windows), and its
                   change against the first scheme's run (with a quantized cache every token
                   attends the keys and values as stored, its own chunk's too)
  KV B/token       the KV cache's bytes per token (all layers, K and V, scales included)
  2k seqs in 1 GiB sequences of 2,048 tokens whose KV fits in a 1 GiB budget beside the model's
                   resident bytes

Prints a table; --out writes the records as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))
MARK = "QUANT "


def child(args) -> None:
    from cluster.config import CacheConfig, EngineConfig
    from cluster.engine.engine import LLMEngine
    from cluster.kv.paged_cache import resident_bytes
    from cluster.model.quant_linear import QuantLinear, set_dense_rows
    from cluster.types import SamplingParams
    from perplexity import windows
    from vllm_offline import measure, prompts
    weights, _, kv = args.child.partition("/")
    weights, kernel_only = weights.removesuffix("+kernel"), weights.endswith("+kernel")
    weights, a8, _ = weights.partition("+a8")
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", quantization=weights,
                                    quantized_activations="int8" if a8 == "+a8" else "none",
                                    num_threads=args.threads, cache=CacheConfig(num_blocks=1024,
                                                                                kv_cache_dtype=kv or "auto")))
    load_s = time.perf_counter() - t0
    if kernel_only:
        set_dense_rows(engine.model, None)
    linears = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    table = engine.model.embed_tokens.weight      # not quantized by any scheme; a tied head shares it
    weight = resident_bytes(engine.model) - table.numel() * table.element_size()
    vocab = engine.model_config.vocab_size
    salts = iter(range(1 << 30))

    def generate(batch, n):
        engine.generate(batch, SamplingParams(max_tokens=n, ignore_eos=True, cache_salt=f"r{next(salts)}"))
    decode = {b: measure(generate, vocab, b, 64, 64, args.repeats)["decode_tok_s"] for b in (1, 8)[:args.batches]}
    if args.batches > 2:
        decode["8@1k"] = measure(generate, vocab, 8, 1024, 64, args.repeats)["decode_tok_s"]
    long = prompts(vocab, 1, 512, 99)
    generate(long, 1)
    t0 = time.perf_counter()
    generate(prompts(vocab, 1, 512, 100), 1)
    ttft = time.perf_counter() - t0
    chunks = windows(engine.tokenizer, args.windows, 512)
    outs = engine.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll = [-lp.logprob for o in outs for lp in o.prompt_logprobs if lp is not None]
    per_token = engine.layout.bytes_per_block() / engine.layout.block_size
    print(MARK + json.dumps({
        "scheme": args.child, "load_s": load_s, "weight_bytes": weight, "resident_bytes": resident_bytes(engine.model),
        "formats": sorted({m.qweight.format.value for m in linears if isinstance(m, QuantLinear)}) or ["bf16"],
        "decode_tok_s": decode, "ttft_512_ms": 1e3 * ttft, "perplexity": math.exp(sum(nll) / len(nll)),
        "kv_bytes_per_token": per_token,
        "seqs_2k_in_1gib": ((1 << 30) - resident_bytes(engine.model)) / (per_token * 2048)}),
        flush=True)


def run(args, scheme: str) -> dict:
    cmd = [sys.executable, __file__, "--child", scheme, "--model", str(args.model), "--threads", str(args.threads),
           "--repeats", str(args.repeats), "--windows", str(args.windows), "--batches", str(args.batches)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{scheme}: no result (exit {out.returncode}):\n{out.stderr[-3000:]}")


def _median_of_rounds(records: list[dict]) -> dict:
    """One record of a scheme's rounds: the median of each speed and of TTFT (the rest is equal)."""
    out = dict(records[-1])
    out["decode_tok_s"] = {k: statistics.median(r["decode_tok_s"][k] for r in records) for k in out["decode_tok_s"]}
    out["ttft_512_ms"] = statistics.median(r["ttft_512_ms"] for r in records)
    return out


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| scheme | formats | weight MiB | resident MiB | decode b1 tok/s | vs base | decode b8 tok/s | vs base "
             "| b8@1k tok/s | vs base | TTFT 512 ms | perplexity | vs base | KV B/token | 2k seqs in 1 GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    def speed(r: dict, key: str) -> str:   # a batch not measured (--batches): blank
        d, bd = r["decode_tok_s"], base["decode_tok_s"]
        return f"{d[key]:.1f} | {d[key] / bd[key]:.2f}x" if key in d else " | "
    for r in rows:
        lines.append(
            f"| {r['scheme']} | {'/'.join(r['formats'])} | {r['weight_bytes'] / 2**20:.1f} | "
            f"{r['resident_bytes'] / 2**20:.1f} | {speed(r, '1')} | {speed(r, '8')} | {speed(r, '8@1k')} | "
            f"{r['ttft_512_ms']:.0f} | "
            f"{r['perplexity']:.3f} | {100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}% | "
            f"{r['kv_bytes_per_token']:.0f} | {r['seqs_2k_in_1gib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the project's default model (its GGUF)")
    ap.add_argument("--schemes", nargs="+", default=["none", "int8", "int4", "gguf"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="run the schemes round-robin N times (one child each "
                                                          "time); speed and TTFT are the medians of the rounds")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of 512 tokens for perplexity")
    ap.add_argument("--batches", type=int, default=3, choices=(1, 2, 3),
                    help="decode speeds measured: 1 (batch 1), 2 (and batch 8), 3 (and batch 8 after 1k prompts)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from cluster.config import default_model_dir
        args.model = default_model_dir()
    if args.child:
        child(args)
        return
    runs: dict[str, list[dict]] = {s: [] for s in args.schemes}
    for _ in range(args.rounds):     # round-robin: machine noise lands on every scheme alike
        for scheme in args.schemes:
            runs[scheme].append(run(args, scheme))
            print(json.dumps(runs[scheme][-1]), flush=True)
    rows = [_median_of_rounds(runs[s]) for s in args.schemes]
    import platform
    print(f"\n{args.model.name}, {args.threads} threads, {platform.processor() or ''}".rstrip())
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
