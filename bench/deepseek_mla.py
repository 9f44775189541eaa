"""DeepSeek-V3-shaped latent attention (MLA) and experts: decode and prefill against transformers
on one random checkpoint scaled to this machine, the KV bytes a token against per-head K/V, and
the absorbed decode's C op against its torch reference at DeepSeek-V3's own attention shape.

    python bench/deepseek_mla.py [--dtype bfloat16] [--threads 2] [--new-tokens 16] [--skip-hf] [--dense-only]
                                 [--vllm]

DeepSeek-V3 is 61 layers of hidden 7168, 128 heads (q_lora 1536, kv_lora 512, RoPE 64, nope 128,
v 128), 256 routed experts of 2048 (top 8 of 8 groups, 4 kept) + 1 shared, the first 3 layers
dense. Scaled here: 12 layers of hidden 1024, 16 heads (q_lora 384, kv_lora 256, RoPE 64, nope
64, v 64: a latent of 320, one of the widths vLLM's MLA backends take), 64 experts of 384 (top 8 of 8 groups, 4 kept) + 1 shared, the first layer dense (2816),
vocab 32k: ~1.0 B parameters, ~0.2 B active. `--dense-only` makes every layer dense (an MLA model
without experts, ~0.2 B). Decode tok/s = 8 * (n - 1) / (t(n) - t(1)) at batch 8; prefill tok/s
= 512 / t(1 token) of one 512-token prompt; greedy, eos ignored. Figures on a shared machine are
noisy: the run prints how busy the CPU was with other work.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_vs_transformers import bench_hf, time_ours
from llama_cpp_compare import busy_s
from moe import try_vllm  # vLLM's CPU build on a checkpoint, in its own process

SHAPE = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
         "q_lora_rank": 384, "kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
         "intermediate_size": 2816, "n_routed_experts": 64, "moe_intermediate_size": 384, "num_experts_per_tok": 8,
         "n_group": 8, "topk_group": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "routed_scaling_factor": 2.5, "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 1,
         "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 0}
# What DeepSeek-V3's own config.json says and transformers' config leaves out (vLLM reads them).
V3_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def make_checkpoint(out: Path, dtype: torch.dtype, dense_only: bool) -> Path:
    import transformers
    from tiny_models import make_tokenizer
    if (out / "config.json").is_file():
        return out
    shape = dict(SHAPE, first_k_dense_replace=SHAPE["num_hidden_layers"]) if dense_only else SHAPE
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**shape)).to(dtype)
    with torch.no_grad():   # a correction bias that moves the choice, as a trained router's does
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.01)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, **V3_ROUTING}, indent=2))
    make_tokenizer(out, bos=True)
    return out


def parameters(model_dir: Path) -> tuple[float, float]:
    """(total, active per token) in billions, counted on the checkpoint's tensors: of the routed
    experts, top_k of num_experts are active."""
    from safetensors import safe_open

    from cluster.model.model_config import load_model_config
    moe = load_model_config(model_dir).mla.moe
    total = active = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():   # noqa: SIM118 - safe_open is not a dict
                n = st.get_slice(name).get_shape()
                count = 1
                for d in n:
                    count *= d
                total += count
                routed = ".mlp.experts." in name
                active += count * moe.top_k // moe.num_experts if routed and moe else count
    return total / 1e9, active / 1e9


def ours(model_dir: Path, args):
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    from cluster.model.mla_engine import mha_bytes_per_token
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=args.dtype, num_threads=args.threads,
                                    cache=CacheConfig(memory_budget_bytes=8 << 30),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=1024)))
    mc = engine.model_config
    kv = (engine.layout.bytes_per_token(), mha_bytes_per_token(mc, engine.dtype))
    params = parameters(model_dir)
    kernel = getattr(engine.runner.backend.decode_kernel, "__name__", "?")
    t1, tn = time_ours(engine, 8, args.decode_prompt, args.new_tokens, args.repeats)
    p1, _ = time_ours(engine, 1, 512, 2, args.repeats)
    del engine
    return 8 * (args.new_tokens - 1) / (tn - t1), 512 / p1, kv, params, kernel


# (heads, compressed, RoPE, rows, tokens a row): the bench model's attention, and DeepSeek-V3's own.
KERNEL_CASES = ((16, 256, 64, 8, 48), (16, 256, 64, 8, 512), (16, 256, 64, 1, 2048), (128, 512, 64, 1, 256),
                (128, 512, 64, 8, 1024))


def decode_kernels(args) -> list[str]:
    """The absorbed decode, one layer: the C op against the torch reference (what decides
    mla_engine.C_DECODE_MAX_HEADS)."""
    from kernels import cpu_ops, mla_decode
    if cpu_ops.load() is None or not cpu_ops.has_mla_decode():
        return ["C op not built here"]
    dtype = getattr(torch, args.dtype)
    lines = []
    for heads, c_dim, p_dim, rows, tokens in KERNEL_CASES:
        g = torch.Generator().manual_seed(0)
        blocks = rows * (tokens // 16 + 1) + 4
        kv = torch.randn(2, blocks, 16, 1, (c_dim + p_dim) // 2, generator=g).to(dtype)
        q_lat = torch.randn(rows, heads, c_dim, generator=g).to(dtype)
        q_pe = torch.randn(rows, heads, p_dim, generator=g).to(dtype)
        tables = torch.stack([torch.randperm(blocks, generator=g)[:tokens // 16 + 1] for _ in range(rows)])
        lens = torch.full((rows,), tokens)
        ms = []
        for fn in (mla_decode.mla_decode_reference, cpu_ops.mla_decode):
            fn(q_lat, q_pe, kv, tables, lens, 0.1)
            t = time.perf_counter()
            for _ in range(5):
                fn(q_lat, q_pe, kv, tables, lens, 0.1)
            ms.append((time.perf_counter() - t) / 5 * 1e3)
        lines.append(f"absorbed decode, {heads} heads, latent {c_dim}+{p_dim}, {rows} x {tokens} tokens: torch "
                     f"{ms[0]:.2f} ms, C {ms[1]:.2f} ms ({ms[1] / ms[0]:.2f}x torch's time)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/splitserve-deepseek-bench"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--decode-prompt", type=int, default=32, help="prompt length of the batch-8 decode runs")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dense-only", action="store_true", help="every layer dense (no experts)")
    ap.add_argument("--vllm", action="store_true", help="also try vLLM's CPU build on the checkpoint")
    ap.add_argument("--vllm-venv", default="/work/vllm-venv")
    ap.add_argument("--vllm-timeout", type=int, default=600)
    ap.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's share of host memory for its KV")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model_dir = make_checkpoint(args.out / f"{'dense' if args.dense_only else 'moe'}-{args.dtype}",
                                getattr(torch, args.dtype), args.dense_only)
    busy0, own0, wall0 = busy_s(), sum(os.times()[:2]), time.monotonic()
    decode, prefill, (kv, mha), (total, active), kernel = ours(model_dir, args)
    print(f"checkpoint {model_dir}: {total:.2f} B total, {active:.2f} B active; absorbed decode: {kernel}")
    print(f"KV a token: {kv:,} B latent against {mha:,} B of per-head K and V ({kv / mha:.1%}, 1/{mha / kv:.0f})")
    hf_decode, hf_prefill = (float("nan"),) * 2
    if not args.skip_hf:
        hf_prefill, hf_decode = bench_hf(model_dir, getattr(torch, args.dtype), 8, args.decode_prompt,
                                         args.new_tokens, args.repeats)
        hf_prefill = bench_hf(model_dir, getattr(torch, args.dtype), 1, 512, 2, args.repeats)[0]
    print(f"decode@8 ours {decode:.1f} tok/s, transformers {hf_decode:.1f} ({decode / hf_decode:.2f}x) | "
          f"prefill 512 ours {prefill:.0f} tok/s, transformers {hf_prefill:.0f} ({prefill / hf_prefill:.2f}x)")
    print("\n".join(decode_kernels(args)))
    if args.vllm:
        print(try_vllm(model_dir, args))
    own = sum(os.times()[:2]) - own0
    busy = max(0.0, (busy_s() - busy0 - own) / ((time.monotonic() - wall0) * os.cpu_count()))
    print(f"CPU busy with other work: {busy:.0%} of {os.cpu_count()} cores during the run (figures are noisy)")


if __name__ == "__main__":
    main()
