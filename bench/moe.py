"""Mixture-of-experts decode and prefill: a Qwen3-30B-A3B shape scaled to this machine against a
dense model of the same active size and against transformers, in one run.

    python bench/moe.py [--dtype bfloat16] [--threads 2] [--new-tokens 16] [--skip-hf] [--vllm]

Qwen3-30B-A3B is 48 layers of hidden 2048, 128 experts of intermediate 768, top-8, 32/4 heads of
128. Scaled here: 12 layers of hidden 1024, 64 experts of intermediate 384, top-8 (the same 1/8
to 1/16 expert sparsity), 16/4 heads of 64, vocab 32k: ~1.0 B parameters, ~0.2 B active per
token. The dense model (Qwen3, the same attention) has an MLP of 8 x 384 = 3072: the same active
parameters. Random weights, built once into --out. Decode tok/s = 8 * (n - 1) / (t(n) - t(1)) at
batch 8; prefill tok/s = 512 / t(1 token) of one 512-token prompt; greedy, eos ignored.
Figures on a shared machine are noisy: the run prints how busy the CPU was with other work.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_vs_transformers import bench_hf, time_ours  # noqa: E402
from llama_cpp_compare import busy_s  # noqa: E402

COMMON = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
          "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048, "bos_token_id": 0,
          "eos_token_id": 1, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
MOE = {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 384, "norm_topk_prob": True,
       "decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": 3072}
DENSE_INTERMEDIATE = 8 * 384


def make_checkpoint(out: Path, kind: str, dtype: torch.dtype) -> Path:
    """The random-weight checkpoint of `kind` (moe | dense) in `out`, built once."""
    import transformers
    from tiny_models import make_tokenizer
    if (out / "config.json").is_file():
        return out
    if kind == "moe":
        cfg, cls = transformers.Qwen3MoeConfig(**COMMON, **MOE), transformers.Qwen3MoeForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**COMMON, intermediate_size=DENSE_INTERMEDIATE), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(dtype)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(out)
    make_tokenizer(out, bos=True)
    return out


def parameters(model_dir: Path) -> tuple[float, float]:
    """(total, active per token) in billions, from the config as the engine reads it."""
    from cluster.model.model_config import load_model_config
    mc = load_model_config(model_dir)
    total = mc.num_parameters()
    if mc.moe is None:
        return total / 1e9, total / 1e9
    h = mc.hidden_size
    active = total - mc.moe.mlp_parameters(h, mc.intermediate_size) + mc.moe.mlp_parameters(h, mc.intermediate_size,
                                                                                              active=True)
    return total / 1e9, active / 1e9


def ours(model_dir: Path, args) -> tuple[float, float]:
    """(decode tok/s at batch 8, prefill tok/s of one 512-token prompt) of this engine."""
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=args.dtype, num_threads=args.threads,
                                    cache=CacheConfig(memory_budget_bytes=8 << 30),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=1024)))
    t1, tn = time_ours(engine, 8, args.decode_prompt, args.new_tokens, args.repeats)
    p1, _ = time_ours(engine, 1, 512, 2, args.repeats)
    del engine
    return 8 * (args.new_tokens - 1) / (tn - t1), 512 / p1


def hf(model_dir: Path, args) -> tuple[float, float]:
    dtype = getattr(torch, args.dtype)
    _, decode = bench_hf(model_dir, dtype, 8, args.decode_prompt, args.new_tokens, args.repeats)
    prefill, _ = bench_hf(model_dir, dtype, 1, 512, 2, args.repeats)
    return decode, prefill


def try_vllm(model_dir: Path, args) -> str:
    """vLLM's CPU build (/work/vllm-venv) on the same checkpoint, in its own process: its figures,
    or why it did not load."""
    py = Path(args.vllm_venv) / "bin" / "python"
    if not py.is_file():
        return f"vLLM: no interpreter at {py}"
    code = (f"import time; from vllm import LLM, SamplingParams as S; "
            f"llm = LLM(model={str(model_dir)!r}, dtype={args.dtype!r}, max_model_len=1024, enforce_eager=True); "
            f"p = [[3 + (i * 7 + j) % 30000 for j in range({args.decode_prompt})] for i in range(8)]; "
            f"llm.generate(p, S(max_tokens=2, ignore_eos=True)); t = time.perf_counter(); "
            f"llm.generate(p, S(max_tokens=1, ignore_eos=True)); t1 = time.perf_counter() - t; t = time.perf_counter(); "
            f"llm.generate(p, S(max_tokens={args.new_tokens}, ignore_eos=True)); tn = time.perf_counter() - t; "
            f"print('VLLM', 8 * ({args.new_tokens} - 1) / (tn - t1))")
    try:
        out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=args.vllm_timeout,
                             check=False)
    except subprocess.TimeoutExpired:
        return f"vLLM: did not finish within {args.vllm_timeout} s"
    for line in out.stdout.splitlines():
        if line.startswith("VLLM "):
            return f"vLLM CPU decode at batch 8: {float(line.split()[1]):.1f} tok/s"
    tail = [ln for ln in (out.stderr or out.stdout).splitlines() if ln.strip()][-3:]
    return "vLLM did not load it: " + " | ".join(tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/splitserve-moe-bench"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--decode-prompt", type=int, default=32, help="prompt length of the batch-8 decode runs")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="also try vLLM's CPU build on the MoE checkpoint")
    ap.add_argument("--vllm-venv", default="/work/vllm-venv")
    ap.add_argument("--vllm-timeout", type=int, default=600)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    dirs = {k: make_checkpoint(args.out / f"{k}-{args.dtype}", k, dtype) for k in ("moe", "dense")}
    busy0, own0, wall0 = busy_s(), sum(os.times()[:2]), time.monotonic()
    rows = {}
    for kind, d in dirs.items():
        total, active = parameters(d)
        decode, prefill = ours(d, args)
        hf_decode, hf_prefill = (float("nan"),) * 2 if args.skip_hf else hf(d, args)
        rows[kind] = {"total_b": round(total, 3), "active_b": round(active, 3), "decode": decode,
                      "prefill": prefill, "hf_decode": hf_decode, "hf_prefill": hf_prefill}
        print(f"{kind:>5}: {total:.2f} B total, {active:.2f} B active | decode@8 ours {decode:7.1f} tok/s, "
              f"transformers {hf_decode:7.1f} ({decode / hf_decode:.2f}x) | prefill 512 ours {prefill:7.0f} tok/s, "
              f"transformers {hf_prefill:7.0f} ({prefill / hf_prefill:.2f}x)", flush=True)
    moe, dense = rows["moe"], rows["dense"]
    print(f"MoE decode at batch 8 / dense of the same active size: {moe['decode'] / dense['decode']:.2f}x "
          f"(dense is {dense['decode'] / moe['decode']:.2f}x faster)")
    if args.vllm:
        print(try_vllm(dirs["moe"], args))
    own = sum(os.times()[:2]) - own0
    busy = max(0.0, (busy_s() - busy0 - own) / ((time.monotonic() - wall0) * os.cpu_count()))
    print(f"CPU busy with other work during the rounds: {busy:.0%} of the machine"
          + ("  <- not a quiet machine: compare with care" if busy > 0.2 else ""))
    print(json.dumps({"dtype": args.dtype, "threads": args.threads, **rows}))


if __name__ == "__main__":
    main()
