"""What each proposer's choice for crossing the P/D handoff costs, on the default model.

 - draft: its KV is rebuilt on the decode worker, so the first decode step also runs the draft
   over the whole prompt. Measured: that catch-up time against the target's prefill of the prompt.
 - eagle: its KV rides in the handed-off blocks as one more layer and one hidden state travels in
   the handle. Measured: the extra bytes per block, and the prefill time with and without the
   head running over the prompt.

    python bench/spec_handoff_cost.py --lengths 500 2000
"""
from __future__ import annotations

import argparse
import time

import torch

from cluster.config import DEFAULT_EAGLE_DIR, STDLIB_CODER_DIR, EngineConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.sequence import Sequence
from cluster.types import SamplingParams
from decode.spec.speculator import make_kv_only_speculator, make_speculator


def prefill_seconds(engine: LLMEngine, prompt: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        engine.pool.reset_prefix_cache()
        t0 = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1))
        best = min(best, time.perf_counter() - t0)
    return best


def draft_catch_up_seconds(engine: LLMEngine, prompt: list[int], repeats: int) -> float:
    proposer = engine.speculator.proposers["draft"]
    best = float("inf")
    for _ in range(repeats):
        seq = Sequence("x", tuple(prompt), SamplingParams(), token_ids=[*prompt, 1], num_computed_tokens=len(prompt))
        t0 = time.perf_counter()
        proposer.propose([seq], [1], [None])    # the catch-up pass over prompt + first token, one draft token
        best = min(best, time.perf_counter() - t0)
        proposer.release(seq)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[500, 2000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    plain = LLMEngine(EngineConfig(model=STDLIB_CODER_DIR, num_threads=args.threads))
    drafted = LLMEngine(EngineConfig(model=STDLIB_CODER_DIR, num_threads=args.threads, speculative=SpeculativeConfig(method="draft")),
                        speculator_factory=make_speculator)
    eagle = None
    if DEFAULT_EAGLE_DIR.is_dir():
        # A prefill worker's engine: the head runs over the prompt, nothing is proposed.
        eagle = LLMEngine(EngineConfig(model=STDLIB_CODER_DIR, num_threads=args.threads,
                                       speculative=SpeculativeConfig(method="eagle")),
                          speculator_factory=make_kv_only_speculator)
        extra = eagle.layout.bytes_per_block() / plain.layout.bytes_per_block() - 1
        print(f"eagle: KV bytes per block {plain.layout.bytes_per_block()} -> {eagle.layout.bytes_per_block()} "
              f"(+{extra:.1%} per handoff), plus {eagle.model_config.hidden_size * eagle.dtype.itemsize} bytes "
              "of hidden state in the handle")
    warm = torch.randint(1, plain.model_config.vocab_size, (64,), generator=g).tolist()
    for engine in (plain, drafted, eagle):
        if engine is not None:
            prefill_seconds(engine, warm, 1)
    for n in args.lengths:
        prompt = torch.randint(1, plain.model_config.vocab_size, (n,), generator=g).tolist()
        base = prefill_seconds(plain, prompt, args.repeats)
        catch_up = draft_catch_up_seconds(drafted, prompt, args.repeats)
        line = (f"{n:>5} tokens: target prefill {base * 1e3:7.1f} ms | draft rebuilt on decode "
                f"{catch_up * 1e3:6.1f} ms ({catch_up / base:.1%} of prefill)")
        if eagle is not None:
            with_head = prefill_seconds(eagle, prompt, args.repeats)
            line += f" | prefill with EAGLE head {with_head * 1e3:7.1f} ms (+{with_head / base - 1:.1%})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
