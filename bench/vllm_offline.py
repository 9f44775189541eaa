"""vLLM's CPU build, offline (`vllm.LLM`), timed as bench/engine_vs_vllm.py times every engine.

    /work/vllm-venv/bin/python bench/vllm_offline.py --model DIR --dtype bfloat16 [--batches 1 8 32]
        [--prompt-len 256] [--new-tokens 128] [--repeats 2] [--enforce-eager]

Started by bench/engine_vs_vllm.py under the vLLM venv's Python, with the environment it sets
(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE, LD_PRELOAD, no PYTHONPATH). Prints one line
`RESULT {json}` with vLLM's settings, then one per batch; vLLM's own logging goes around them.
Imports nothing from splitserve. `prompts` and `measure` (stdlib only) are also what the parent
uses for the other engines, so that every engine gets the same prompts and the same formula.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

MARK = "RESULT "


def prompts(vocab: int, batch: int, prompt_len: int, run: int) -> list[list[int]]:
    """Random token ids, distinct per timed run, so no run hits a prefix cached by an earlier one."""
    rng = random.Random(f"{batch}/{prompt_len}/{run}")
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def measure(generate, vocab: int, batch: int, prompt_len: int, new: int, repeats: int) -> dict:
    """generate(prompts, n) makes n tokens for every prompt. Prefill tok/s = B*P / t(1 token);
    decode tok/s = B*(N-1) / (t(N tokens) - t(1 token)); each t the best of `repeats`, after a warm-up."""
    runs = iter(range(1 << 30))
    generate(prompts(vocab, batch, prompt_len, next(runs)), 2)

    def best(n: int) -> float:
        times = []
        for _ in range(repeats):
            p = prompts(vocab, batch, prompt_len, next(runs))
            t0 = time.perf_counter()
            generate(p, n)
            times.append(time.perf_counter() - t0)
        return min(times)
    t1, tn = best(1), best(new)
    return {"batch": batch, "t1_s": t1, "tn_s": tn, "prefill_tok_s": batch * prompt_len / t1,
            "decode_tok_s": batch * (new - 1) / (tn - t1) if tn > t1 else None}   # None: too noisy to tell


def emit(record: dict) -> None:
    print(MARK + json.dumps(record), flush=True)


def _load_shim() -> None:
    """bench/vllm_shim.py, loaded by path: it maps version("vllm") to vllm-cpu's and drops bench/
    from sys.path (a script there must not shadow a package vLLM imports). By path, because a process that
    vLLM spawns re-runs this file with bench/ already gone from its inherited sys.path."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_shim.py")
    spec = importlib.util.spec_from_file_location("_splitserve_vllm_shim", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)   # ours gets the same
    ap.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile of the model")
    args = ap.parse_args()
    import importlib.metadata as md
    from vllm import LLM, SamplingParams
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_seqs=max(256, max(args.batches)), max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, seed=0)
    # After LLM(): vLLM's CPU platform has then added its own LD_PRELOAD entries, which its
    # spawned engine process runs with.
    emit({"settings": {
        "vllm": md.version("vllm"), "torch": md.version("torch"), "enforce_eager": args.enforce_eager,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
        **{k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")}}})

    def generate(batch: list[list[int]], n: int) -> None:
        sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
    for b in args.batches:
        emit(measure(generate, vocab, b, args.prompt_len, args.new_tokens, args.repeats))


if __name__ in ("__main__", "__mp_main__"):   # __mp_main__: re-run by a spawned vLLM process
    _load_shim()
if __name__ == "__main__":
    main()
