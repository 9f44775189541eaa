"""Mixture-of-experts decode and prefill: a Qwen3-30B-A3B shape scaled to this machine against a
dense model of the same active size and against transformers, in one run.

    python bench/moe.py [--dtype bfloat16] [--threads 2] [--new-tokens 16] [--skip-hf] [--vllm]

Qwen3-30B-A3B is 48 layers of hidden 2048, 128 experts of intermediate 768, top-8, 32/4 heads of
128. Scaled here: 12 layers of hidden 1024, 64 experts of intermediate 384, top-8 (the same 1/8
to 1/16 expert sparsity), 16/4 heads of 64, vocab 32k: ~1.0 B parameters, ~0.2 B active per
token. The dense model (Qwen3, the same attention) has an MLP of 8 x 384 = 3072: the same active
parameters. Random weights, built once into --out. Decode tok/s = 8 * (n - 1) / (t(n) - t(1)) at
batch 8; prefill tok/s = 512 / t(1 token) of one 512-token prompt; greedy, eos ignored; each
by wall time and by this process's CPU time (the steadier on a busy machine; at --threads 1 it
is the work done). Figures on a shared machine are noisy: the run prints how busy the CPU was.
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


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of fn(). On a busy machine the CPU time is the
    steadier figure (it leaves out the time other processes held the cores), at 1 thread exact."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _rates(run, args) -> dict:
    """Decode tok/s at batch 8 and prefill tok/s of one 512-token prompt, by wall and by CPU time;
    `run(batch, prompt_len, new_tokens)` generates."""
    run(8, args.decode_prompt, 2)   # warm-up
    out = {}
    t1 = [min(x) for x in zip(*(_timed(lambda: run(8, args.decode_prompt, 1)) for _ in range(args.repeats)))]
    tn = [min(x) for x in zip(*(_timed(lambda: run(8, args.decode_prompt, args.new_tokens)) for _ in range(args.repeats)))]
    p1 = [min(x) for x in zip(*(_timed(lambda: run(1, 512, 1)) for _ in range(args.repeats)))]
    for clock, name in enumerate(("wall", "cpu")):
        out[f"{name}_decode"] = 8 * (args.new_tokens - 1) / (tn[clock] - t1[clock])
        out[f"{name}_prefill"] = 512 / p1[clock]
    return out


def _prompts(batch: int, length: int) -> list[list[int]]:
    return torch.randint(3, 32000, (batch, length), generator=torch.Generator().manual_seed(batch)).tolist()


def ours(model_dir: Path, args) -> dict:
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=args.dtype, num_threads=args.threads,
                                    cache=CacheConfig(memory_budget_bytes=8 << 30),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=1024)))
    salt = iter(range(10**6))

    def run(batch, length, n):   # a fresh cache salt: no prefix hits across runs
        engine.generate(_prompts(batch, length), SamplingParams(max_tokens=n, ignore_eos=True,
                                                                cache_salt=f"r{next(salt)}"))
    return _rates(run, args)


def hf(model_dir: Path, args) -> dict:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()

    def run(batch, length, n):
        ids = torch.tensor(_prompts(batch, length))
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return _rates(run, args)


def try_vllm(model_dir: Path, args) -> str:
    """vLLM's CPU build (/work/vllm-venv) on the same checkpoint, in its own process: its figures,
    or why it did not load."""
    py = Path(args.vllm_venv) / "bin" / "python"
    if not py.is_file():
        return f"vLLM: no interpreter at {py}"
    code = (f"import time; from vllm import LLM, SamplingParams as S; "
            f"llm = LLM(model={str(model_dir)!r}, dtype={args.dtype!r}, max_model_len=1024, enforce_eager=True, "
            f"gpu_memory_utilization={args.vllm_memory}); "
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
    lines = [ln for ln in (out.stderr or out.stdout).splitlines() if ln.strip()]
    causes = [ln for ln in lines if "Error:" in ln] or lines[-3:]   # the root cause, not the wrapper's last line
    return "vLLM did not load it: " + " | ".join(causes[:2])


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
    ap.add_argument("--vllm-memory", type=float, default=0.3,
                    help="vLLM's --gpu-memory-utilization: on CPU the share of host memory it reserves")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    dirs = {k: make_checkpoint(args.out / f"{k}-{args.dtype}", k, dtype) for k in ("moe", "dense")}
    busy0, own0, wall0 = busy_s(), sum(os.times()[:2]), time.monotonic()
    rows = {}
    for kind, d in dirs.items():
        total, active = parameters(d)
        rows[kind] = {"total_b": round(total, 3), "active_b": round(active, 3), "ours": ours(d, args)}
        if not args.skip_hf:
            rows[kind]["hf"] = hf(d, args)
        for clock in ("wall", "cpu"):
            o, h = rows[kind]["ours"], rows[kind].get("hf")
            line = f"{kind:>5} ({total:.2f} B, {active:.2f} B active), by {clock:>4}: decode@8 ours {o[clock + '_decode']:7.1f} tok/s"
            if h:
                line += f", transformers {h[clock + '_decode']:6.1f} ({o[clock + '_decode'] / h[clock + '_decode']:.2f}x)"
            line += f" | prefill 512 ours {o[clock + '_prefill']:6.0f} tok/s"
            if h:
                line += f", transformers {h[clock + '_prefill']:6.0f} ({o[clock + '_prefill'] / h[clock + '_prefill']:.2f}x)"
            print(line, flush=True)
    for clock in ("wall", "cpu"):
        ratio = rows["dense"]["ours"][clock + "_decode"] / rows["moe"]["ours"][clock + "_decode"]
        print(f"decode at batch 8 by {clock}: the dense model of the same active size is {ratio:.2f}x the MoE's")
    if args.vllm:
        print(try_vllm(dirs["moe"], args))
    own = sum(os.times()[:2]) - own0
    busy = max(0.0, (busy_s() - busy0 - own) / ((time.monotonic() - wall0) * os.cpu_count()))
    print(f"CPU busy with other work during the rounds: {busy:.0%} of the machine"
          + ("  <- not a quiet machine: compare with care" if busy > 0.2 else ""))
    print(json.dumps({"dtype": args.dtype, "threads": args.threads, **rows}))


if __name__ == "__main__":
    main()
