"""Perplexity of the served model on held-out text, ours against transformers on the same weights.

    python bench/perplexity.py [--model DIR|FILE.gguf] [--dtype float32] [--windows 16] [--window 512]

Held-out text: this repository's own documentation (docs/*.md, README.md), written after every
published model's training data was collected. It is tokenized once and cut into --windows
windows of --window tokens; each window's tokens from the second on are scored by our engine
(`prompt_logprobs`, the logprob of each prompt token given the ones before) and by transformers'
forward pass on the same Hugging Face directory (for a GGUF: the directory converted from it,
which transformers' own GGUF loader reproduces exactly, tests/integration/test_gguf_model.py).
Prints both perplexities and their relative difference (the goal: within 0.5%).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def windows(tokenizer, n: int, size: int) -> list[list[int]]:
    text = "\n\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    step = max(size, (len(ids) - size) // max(1, n - 1))
    return [ids[i:i + size] for i in range(0, len(ids) - size + 1, step)][:n]


def ours(model: Path, dtype: str, chunks: list[list[int]], threads: int) -> tuple[float, float]:
    from cluster.config import CacheConfig, EngineConfig
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, num_threads=threads, kernels="torch",
                                    cache=CacheConfig(num_blocks=2 * len(chunks) * (len(chunks[0]) // 16 + 2))))
    start = time.perf_counter()
    outs = engine.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll = [-lp.logprob for o in outs for lp in o.prompt_logprobs if lp is not None]
    return math.exp(sum(nll) / len(nll)), time.perf_counter() - start


def reference(model: Path, dtype: str, chunks: list[list[int]]) -> tuple[float, float]:
    import torch
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).eval()
    start, nll, count = time.perf_counter(), 0.0, 0
    with torch.no_grad():
        for c in chunks:
            ids = torch.tensor([c])
            logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), dim=-1)
            nll -= logp.gather(1, ids[0, 1:, None]).sum().item()
            count += len(c) - 1
    return math.exp(nll / count), time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from cluster.config import default_model_dir, resolve_model
    from cluster.model.loader import load_tokenizer
    model = resolve_model(args.model) if args.model else default_model_dir()
    chunks = windows(load_tokenizer(model), args.windows, args.window)
    mine, t_mine = ours(model, args.dtype, chunks, args.threads)
    ref, t_ref = reference(model, args.dtype, chunks)
    scored = len(chunks) * (args.window - 1)
    print(f"model {model.name}, {args.dtype}, {len(chunks)} windows x {args.window} tokens ({scored} scored)")
    print(f"perplexity: ours {mine:.4f} ({t_mine:.1f} s), transformers {ref:.4f} ({t_ref:.1f} s), "
          f"relative difference {100 * (mine - ref) / ref:+.3f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
