"""Where a speculative step's time goes, in one engine at batch 1, beside plain decoding.

For each `method:k` (k ignored for `off`) a fresh engine on the default model serves the same
held-out chat prompts one at a time (greedy); the speculator's `propose` and its features pass
(`after_forward` + `keep`) are timed around their calls. Prints tokens/s, the ratio to the first
row, ms per engine step, of which drafting and the features pass, and tokens per step.

    PYTHONPATH=. python bench/spec_step_cost.py --dtype bfloat16 --runs off block:4 block:2 eagle:4
"""
from __future__ import annotations

import argparse
import time

from bench.spec_training.smollm_data import chat_ids, heldout_prompts
from cluster.config import EngineConfig, SpeculativeConfig, default_model_dir, default_model_file
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from decode.spec.speculator import make_speculator


class Timer:
    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


def run(method: str, k: int, prompts: list[list[int]], dtype: str, max_tokens: int, threads: int) -> dict:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k) if method != "off" else SpeculativeConfig()
    engine = LLMEngine(EngineConfig(model=default_model_file(), num_threads=threads, dtype=dtype, speculative=spec),
                       speculator_factory=make_speculator)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8))           # warm-up
    drafting, features = Timer(), Timer()
    speculator = engine.speculator
    if method in speculator.proposers:
        proposer = speculator.proposers[method]
        proposer.propose = drafting.wrap(proposer.propose)
    if speculator.features is not None:
        speculator.features.after_forward = features.wrap(speculator.features.after_forward)
        speculator.features.keep = features.wrap(speculator.features.keep)
    tokens = steps = 0
    t0 = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
        while engine.has_unfinished():
            tokens += sum(len(d.token_ids) for d in engine.step())
            steps += 1
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "step_ms": 1000 * wall / steps, "draft_ms": 1000 * drafting.seconds / steps,
            "features_ms": 1000 * features.seconds / steps, "per_step": tokens / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=["off", "block:4", "block:2", "eagle:4"], help="method:k")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    prompts = [chat_ids(tok, p.text)[:1024] for p in heldout_prompts(a.prompts)]
    print(f"dtype {a.dtype}, {a.threads} threads, {a.prompts} held-out prompts, {a.max_tokens} new tokens, batch 1")
    print(f"{'run':>9} {'tok/s':>7} {'ratio':>6} {'ms/step':>8} {'draft':>6} {'feats':>6} {'tok/step':>8}")
    base = None
    for spec in a.runs:
        method, _, k = spec.partition(":")
        r = run(method, int(k or 4), prompts, a.dtype, a.max_tokens, a.threads)
        base = base or r["tok_s"]
        print(f"{spec:>9} {r['tok_s']:7.1f} {r['tok_s'] / base:5.2f}x {r['step_ms']:8.1f} {r['draft_ms']:6.2f} "
              f"{r['features_ms']:6.2f} {r['per_step']:8.2f}", flush=True)


if __name__ == "__main__":
    main()
