"""Decode and prefill throughput of this engine beside transformers `generate`, in one run.

    python bench/engine_vs_transformers.py [--dtype bfloat16] [--batches 1 8 32] [--threads 2]
    python bench/engine_vs_transformers.py --device cuda --batches 1 8 64     # decode graphs on and off

Builds a ~55M-parameter Llama shape with random weights (hidden 512, 8 layers, GQA 8/2, FFN 1408,
vocab 32k) in a temporary folder, unless --model points at a checkpoint. Prompts are 512 random
tokens, 128 new tokens, greedy, eos ignored. Decode tok/s = B * 127 / (t(128 tokens) - t(1 token)),
the same formula for both engines; prefill tok/s = B * 512 / t(1 token). Also prints the time to
first token of a 1,000-token prompt with a cold and with a warm prefix cache (90% shared).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def make_bench_model(out: Path, dtype: torch.dtype) -> Path:
    import transformers
    from tiny_models import make_tokenizer
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                   bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(out)
    make_tokenizer(out, bos=True)
    return out


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_hf(model_dir: Path, dtype: torch.dtype, batch: int, prompt_len: int, new: int, repeats: int,
             device: str = "cpu"):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    vocab = model.config.vocab_size   # --model may be smaller than the 32k bench shape
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).to(device)
    attn = torch.ones_like(ids)

    def run(n):
        with torch.inference_mode():
            model.generate(ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    run(2)
    t1 = _best(lambda: run(1), repeats)
    tn = _best(lambda: run(new), repeats)
    return batch * prompt_len / t1, batch * (new - 1) / (tn - t1)


def time_ours(engine, batch: int, prompt_len: int, new: int, repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` seconds for 1 and for `new` tokens of `batch` prompts."""
    from cluster.types import SamplingParams
    vocab = engine.model_config.vocab_size     # --model may be smaller than the 32k bench shape
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).tolist()

    def run(n, salt):
        sp = SamplingParams(max_tokens=n, ignore_eos=True, cache_salt=salt)  # salt: no cross-run cache hits
        engine.generate(ids, sp)
    counter = iter(range(10**6))
    run(2, "warmup")
    t1 = _best(lambda: run(1, f"r{next(counter)}"), repeats)
    tn = _best(lambda: run(new, f"r{next(counter)}"), repeats)
    engine.pool.check_idle()
    return t1, tn


def bench_ours(engine, batch: int, prompt_len: int, new: int, repeats: int):
    t1, tn = time_ours(engine, batch, prompt_len, new, repeats)
    return batch * prompt_len / t1, batch * (new - 1) / (tn - t1)


def bench_ttft(engine, repeats: int, prompt_len: int = 1000):
    """Cold and warm time to first token of a prompt whose first 90% is shared (a prompt that
    fits the model: `prompt_len` at most)."""
    from cluster.types import SamplingParams
    g = torch.Generator().manual_seed(42)
    vocab = engine.model_config.vocab_size
    total = min(prompt_len, engine.max_model_len - 2)
    shared = torch.randint(3, vocab, (total * 9 // 10,), generator=g).tolist()
    cold, warm = [], []
    for r in range(repeats):
        engine.pool.reset_prefix_cache()
        a = shared + torch.randint(3, vocab, (total - len(shared),), generator=g).tolist()
        b = shared + torch.randint(3, vocab, (total - len(shared),), generator=g).tolist()
        for prompt, sink in ((a, cold), (b, warm)):
            t0 = time.perf_counter()
            next(iter(engine.stream(prompt, SamplingParams(max_tokens=1))))
            sink.append(time.perf_counter() - t0)
    return statistics.median(cold), statistics.median(warm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cpu", help="cuda: ours with decode graphs on and off, beside transformers")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_bench_model(Path(tmp), dtype)
        graph_modes = ("on", "off") if args.device != "cpu" else ("off",)
        engines = {g: LLMEngine(EngineConfig(model=model_dir, dtype=args.dtype, num_threads=args.threads,
                                             device=args.device, cuda_graphs=g,
                                             cache=CacheConfig(memory_budget_bytes=6 << 30),
                                             scheduler=SchedulerConfig(max_num_batched_tokens=4096)))
                   for g in graph_modes}
        engine = engines[graph_modes[0]]
        print(f"# {args.dtype}, {args.device}, {args.threads} threads, prompt {args.prompt_len}, "
              f"{args.new_tokens} new tokens" + (", ours with decode graphs / without" if len(engines) > 1 else ""))
        print(f"{'batch':>5} | {'ours decode':>11} | {'hf decode':>9} | {'ratio':>5} | "
              f"{'ours prefill':>12} | {'hf prefill':>10} | {'ratio':>5}")
        for b in args.batches:
            hp, hd = (float("nan"),) * 2 if args.skip_hf else bench_hf(
                model_dir, dtype, b, args.prompt_len, args.new_tokens, args.repeats, args.device)
            for mode, eng in engines.items():
                op, od = bench_ours(eng, b, args.prompt_len, args.new_tokens, args.repeats)
                tag = f"{b}" + (f" {mode}" if len(engines) > 1 else "")
                print(f"{tag:>5} | {od:>11.0f} | {hd:>9.0f} | {od / hd:>5.2f} | {op:>12.0f} | {hp:>10.0f} | "
                      f"{op / hp:>5.2f}", flush=True)
        total = min(1000, engine.max_model_len - 2)
        cold, warm = bench_ttft(engine, 3, total)
        print(f"TTFT, {total}-token prompt, 90% shared prefix: cold {cold * 1e3:.0f} ms, warm {warm * 1e3:.0f} ms, "
              f"{cold / warm:.1f}x")


if __name__ == "__main__":
    main()
